"""Test-session settings and fixtures shared by every test module."""

import json
import os
import shutil
import sys
from pathlib import Path
from typing import Any

import pytest
import torch

# Tiny models on a small shared machine: one intra-op thread per process avoids OpenMP threads spinning
# against each other (tests start several processes at once). Child processes inherit the variable.
os.environ.setdefault("OMP_NUM_THREADS", "1")
torch.set_num_threads(1)
# Without a GPU, Triton kernels run under Triton's interpreter on CPU tensors. Triton reads the variable
# when it is first imported, so it is set here, before any test module imports it.
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

sys.path.insert(0, str(Path(__file__).parent))  # tiny_models, services

from minedraft.config import EngineConfig  # noqa: E402

from tiny_models import make_tiny_checkpoint  # noqa: E402


def make_pair(root: Path, seed: int = 1, draft_hidden_size: int = 64, draft_seed: int | None = None) -> tuple[str, str]:
    """A tiny qwen3 target (2 layers) and draft (1 layer) as real checkpoint folders under `root`."""
    target = make_tiny_checkpoint(root / "target", arch="qwen3", hidden_size=64, num_layers=2, seed=seed)
    draft = make_tiny_checkpoint(
        root / "draft", arch="qwen3", hidden_size=draft_hidden_size, num_layers=1, seed=seed if draft_seed is None
        else draft_seed,
    )  # fmt: skip
    return str(target), str(draft)


@pytest.fixture(scope="session")
def pair(tmp_path_factory) -> tuple[str, str]:
    """The tiny pair most tests run: (target folder, draft folder). The draft is the target's first layer
    under its own embeddings and head: it agrees with the target now and then, so windows are accepted in
    part."""
    return make_pair(tmp_path_factory.mktemp("pair"))


def pard_draft(draft: str | Path, root: Path, mask_token: int = 7) -> str:
    """A copy of a draft checkpoint whose config.json names a PARD mask token. Its weights were never trained
    for parallel drafting: every mode must still be lossless with it, only slower."""
    folder = root / "draft-pard"
    shutil.copytree(draft, folder)
    config = json.loads((folder / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps({**config, "pard_token": mask_token}))
    return str(folder)


def tiny_config(pair: tuple[str, str], spec: dict[str, Any] | None = None, **overrides: Any) -> EngineConfig:
    """An engine config over `pair` on CPU with the strict kernels (every mode equals ar token for token):
    `spec` the speculative keys (the draft filled in; None: plain ar), `overrides` any other field."""
    target, draft = pair
    fields = {"model": target, "max_model_len": 128, "device": "cpu", "batch_invariant": True, **overrides}
    return EngineConfig(**fields, speculative_config={**spec, "model": draft} if spec else None)


def offline_greedy(config: EngineConfig, prompts: list[list[int]], max_tokens: int) -> list[list[int]]:
    """What the engine alone, in this process, gives each prompt greedily (EOS ignored): the reference."""
    from minedraft.engine.engine import LLMEngine
    from minedraft.sampling.params import SamplingParams

    engine = LLMEngine.local(config)
    params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
    requests = [engine.add_request(p, params) for p in prompts]
    while engine.has_unfinished():
        engine.step()
    return [r.output_ids for r in requests]


def target_probs(logits, params):
    """The target's distribution for one request, each row of `logits` [m, V] -> [m, V] (greedy: one-hot):
    the reference the sampling tests compare with."""
    from minedraft.sampling.sampler import processed_probs

    return processed_probs(logits, [params] * logits.shape[0])


@pytest.fixture(scope="module")
def gateway(stack, tmp_path_factory):
    """`minedraft gateway` in front of the scheduler of the module's own `stack` fixture: the public endpoint a
    cluster has, which parses requests as the scheduler does."""
    import services  # its minedraft imports wait for the path set above

    log = tmp_path_factory.mktemp("gateway") / "gateway.log"
    with services.gateway(stack.address, str(stack.config.target_path), log) as address:
        yield address
