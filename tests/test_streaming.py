"""How a stream hands the step loop's outputs to its reader (frontends/generate.py)."""

from __future__ import annotations

import asyncio

import pytest

from minedraft.engine_client import RequestFailed, StreamItem, send_all
from minedraft.frontends.generate import ErrorKind, GenerateError, Generation, Generator, Limits


async def _read_all(generation: Generation) -> list[StreamItem | GenerateError]:
    items: list[StreamItem | GenerateError] = []
    while True:
        try:
            items.append(await generation.__anext__())
        except StopAsyncIteration:
            return items
        except GenerateError as exc:
            return items + [exc]


def test_a_lagging_reader_gets_the_queued_deltas_joined_and_an_error_after_them() -> None:
    async def scenario() -> list:
        generation = Generation(Generator(tokenizer=None, limits=Limits()), "r", client_chose_id=False)
        send_all([(generation.sink, StreamItem("a", [1])), (generation.sink, StreamItem("b", [2])),
                  (generation.sink, RequestFailed("its output failed"))])  # fmt: skip
        await asyncio.sleep(0)  # the loop runs the one callback that queues all three
        return await _read_all(generation)

    joined, error = asyncio.run(scenario())
    assert (joined.text, joined.token_ids) == ("ab", [1, 2])
    assert isinstance(error, GenerateError) and error.kind is ErrorKind.INTERNAL


def test_deltas_are_not_joined_past_the_last_one() -> None:
    async def scenario() -> tuple[list, Generation]:
        generation = Generation(Generator(tokenizer=None, limits=Limits()), "r", client_chose_id=False)
        last = StreamItem("b", [2], finished=object())  # the finished request (any object will do here)
        for item in (StreamItem("a", [1]), last, StreamItem("never read", [9])):
            generation.sink.queue.put_nowait(item)
        return await _read_all(generation), generation

    items, generation = asyncio.run(scenario())
    assert [(i.text, i.token_ids) for i in items] == [("ab", [1, 2])]
    assert generation.finished is not None and generation.sink.queue.qsize() == 1


@pytest.mark.parametrize("lag", [False, True])
def test_one_reader_in_step_reads_each_delta_alone(lag: bool) -> None:
    """A reader that keeps up gets one message per step; only a backlog is joined."""

    async def scenario() -> list:
        generation = Generation(Generator(tokenizer=None, limits=Limits()), "r", client_chose_id=False)
        read = []
        for step in range(3):
            send_all([(generation.sink, StreamItem(str(step), [step]))])
            if not lag:
                await asyncio.sleep(0)
                read.append(await generation.__anext__())
        if lag:
            await asyncio.sleep(0)
            read.append(await generation.__anext__())
        return [item.token_ids for item in read]

    assert asyncio.run(scenario()) == ([[0, 1, 2]] if lag else [[0], [1], [2]])
