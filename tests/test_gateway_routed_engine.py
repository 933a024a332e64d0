"""The gateway's engine client, under the one gRPC servicer: a group's refusal keeps its status, the client's
deadline bounds each placement, and a request is checked at the gateway once a group has told its limits."""

from __future__ import annotations

import time
from types import SimpleNamespace

import grpc
import pytest

from minedraft.api import generate_pb2
from minedraft.frontends.generate import ErrorKind
from minedraft.frontends.grpc_api import status_of
from minedraft.gateway.routed_engine import RoutedEngine, _refusal, _time_remaining
from minedraft.gateway.router import Refused
from minedraft.sampling.params import SamplingParams


@pytest.mark.parametrize(
    ("code", "kind"),
    [(grpc.StatusCode.RESOURCE_EXHAUSTED, ErrorKind.BUSY), (grpc.StatusCode.NOT_FOUND, ErrorKind.INTERNAL),
     (grpc.StatusCode.UNAUTHENTICATED, ErrorKind.INTERNAL)],
)  # fmt: skip
def test_a_groups_refusal_reaches_the_client_with_its_status(code, kind) -> None:
    error = _refusal(Refused(code, "why"))
    assert (error.kind, error.message, status_of(error)) == (kind, "why", code)


def test_the_clients_deadline_is_counted_down_for_each_placement() -> None:
    assert _time_remaining(None)() is None
    remaining = _time_remaining(time.monotonic() + 30)
    assert 29 < remaining() <= 30


def test_requests_are_checked_at_the_gateway_once_a_group_told_its_limits() -> None:
    engine = RoutedEngine(router=None, tokenizer=SimpleNamespace(vocab_size=100))
    params = SamplingParams(max_tokens=4)
    with pytest.raises(ValueError, match="prompt is empty"):
        engine.check_request([], params)
    engine.check_request(list(range(50)), params)  # no group has told max_model_len: the group checks it
    engine.learn(generate_pb2.ServerInfo(max_model_len=16))
    assert engine.max_model_len == 16
    with pytest.raises(ValueError, match="max_model_len is 16"):
        engine.check_request(list(range(50)), params)
