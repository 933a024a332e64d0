"""LoRA adapters (model/lora.py): the batched math against PEFT's merged model, mixed batches, refusals."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from minedraft.model.checkpoint import CheckpointError, resolve_checkpoint
from minedraft.model.lora import LoraError, LoraOptions
from minedraft.model.runner import ModelRunner, SeqInput

from tiny_models import load_hf_model, make_tiny_checkpoint, torch_threads

PROJECTIONS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


def make_adapter(base: Path, folder: Path, seed: int, rank: int = 4, targets: list[str] | None = None,
                 **config) -> Path:
    """A PEFT adapter with random A and B (PEFT's default starts B at zero, which would test nothing)."""
    from peft import LoraConfig, get_peft_model

    torch.manual_seed(seed)
    peft_config = LoraConfig(r=rank, lora_alpha=2 * rank, target_modules=targets or PROJECTIONS,
                             init_lora_weights=False, **config)
    model = get_peft_model(load_hf_model(base), peft_config)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "lora_" in name:
                param.normal_(0.0, 0.1)
    model.save_pretrained(folder)
    return folder


def merged_checkpoint(base: Path, adapter: Path, folder: Path) -> Path:
    """PEFT's merge_and_unload() of `adapter` into `base`, saved as a plain checkpoint beside base's tokenizer."""
    from peft import PeftModel

    merged = PeftModel.from_pretrained(load_hf_model(base), adapter).merge_and_unload()
    merged.save_pretrained(folder, safe_serialization=True)
    for name in ("tokenizer.json", "generation_config.json"):
        (folder / name).write_bytes((base / name).read_bytes())
    return folder


@pytest.fixture(scope="module", autouse=True)
def _single_thread():
    with torch_threads(1):
        yield


@pytest.fixture(scope="module")
def lora_world(tmp_path_factory):
    """A tiny qwen3 base, three adapters (one rsLoRA, one on attention only) and each one's merged model."""
    root = tmp_path_factory.mktemp("lora")
    base = make_tiny_checkpoint(root / "base", "qwen3", seed=3)
    adapters = {
        "a": make_adapter(base, root / "a", seed=1),
        "b": make_adapter(base, root / "b", seed=2, rank=8, use_rslora=True),
        "c": make_adapter(base, root / "c", seed=3, rank=2, targets=["q_proj", "v_proj"]),
    }
    merged = {name: merged_checkpoint(base, path, root / f"merged-{name}") for name, path in adapters.items()}
    return base, {k: str(v) for k, v in adapters.items()}, merged


def tokens(n: int, seed: int) -> list[int]:
    return torch.randint(3, 320, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def runner(path, lora: LoraOptions | None = None, **kwargs) -> ModelRunner:
    return ModelRunner(path, num_slots=8, max_seq_len=128, batch_invariant=True, lora=lora, **kwargs)


def logits_of(r: ModelRunner, ids: list[int], lora: str | None = None) -> torch.Tensor:
    return r.forward([SeqInput(r.allocate_slot(lora), ids, 0, num_logits=len(ids))])


@pytest.mark.parametrize("batch_invariant", [True, False])
def test_adapter_equals_peft_merged(lora_world, batch_invariant):
    base, adapters, merged = lora_world
    ours = ModelRunner(base, num_slots=8, max_seq_len=128, batch_invariant=batch_invariant,
                       lora=LoraOptions(adapters, max_loras=2, max_rank=8))
    ids = tokens(20, seed=5)
    for name in adapters:
        reference = logits_of(ModelRunner(merged[name], num_slots=1, max_seq_len=128), ids)
        torch.testing.assert_close(logits_of(ours, ids, name), reference, atol=1e-4, rtol=1e-5)
    plain = ModelRunner(base, num_slots=1, max_seq_len=128, batch_invariant=batch_invariant)
    plain.model.model.decode_stack = None  # the kernels of a runner with LoRA (the one-call stack runs none)
    torch.testing.assert_close(logits_of(ours, ids), logits_of(plain, ids), atol=0, rtol=0)  # no adapter: exact


def test_mixed_batch_gives_each_what_it_gives_alone(lora_world):
    """Three adapters and a base request in one forward: each row equals that request run alone."""
    base, adapters, _ = lora_world
    r = runner(base, LoraOptions(adapters, max_loras=3, max_rank=8))
    names = ["a", None, "b", "c"]
    prompts = [tokens(9 + i, seed=10 + i) for i in range(len(names))]
    alone = [logits_of(r, p, n) for p, n in zip(prompts, names, strict=True)]
    slots = [r.allocate_slot(n) for n in names]
    together = r.forward([SeqInput(s, p, 0, num_logits=len(p)) for s, p in zip(slots, prompts, strict=True)])
    torch.testing.assert_close(together, torch.cat(alone), atol=1e-5, rtol=1e-5)


def test_slots_are_reused_least_recent_first(lora_world):
    """One slot, three adapters in turn: each load evicts the last, and results stay each adapter's."""
    base, adapters, merged = lora_world
    r = runner(base, LoraOptions(adapters, max_loras=1, max_rank=8, max_cpu_loras=1))
    ids = tokens(12, seed=7)
    for name in ["a", "b", "a", "c"]:
        reference = logits_of(runner(merged[name]), ids)
        torch.testing.assert_close(logits_of(r, ids, name), reference, atol=1e-4, rtol=1e-5)
    with pytest.raises(LoraError, match="exceed max_loras 1"):
        r.forward([SeqInput(r.allocate_slot("a"), ids, 0), SeqInput(r.allocate_slot("b"), ids, 0)])


def _edit_config(adapter: str, folder: Path, **changes) -> str:
    import shutil

    shutil.copytree(adapter, folder)
    config = json.loads((folder / "adapter_config.json").read_text())
    (folder / "adapter_config.json").write_text(json.dumps({**config, **changes}))
    return str(folder)


@pytest.mark.parametrize("changes, message", [
    ({"use_dora": True}, "use_dora"),
    ({"bias": "all"}, "bias 'all'"),
    ({"modules_to_save": ["lm_head"]}, "modules_to_save"),
    ({"target_modules": ["q_proj", "embed_tokens"]}, "embed_tokens"),
    ({"target_modules": ["lm_head"]}, "lm_head"),
    ({"r": 32}, "rank 32 exceeds max_lora_rank 16"),
])
def test_bad_adapters_refused_by_name(lora_world, tmp_path, changes, message):
    base, adapters, _ = lora_world
    bad = _edit_config(adapters["a"], tmp_path / "bad", **changes)
    with pytest.raises(LoraError, match=message):
        runner(base, LoraOptions({"bad": bad}, max_rank=16))


def test_unknown_adapter_and_adapter_as_model_refused(lora_world):
    base, adapters, _ = lora_world
    r = runner(base, LoraOptions({"a": adapters["a"]}))
    with pytest.raises(LoraError, match="unknown LoRA adapter 'zzz'"):
        logits_of(r, tokens(5, 1), "zzz")
    with pytest.raises(ValueError, match="asked of a model started without LoRA"):
        logits_of(runner(base), tokens(5, 1), "a")
    with pytest.raises(CheckpointError, match="is a LoRA adapter.*--enable-lora --lora-modules"):
        resolve_checkpoint(adapters["a"])


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    """The tiny target/draft pair, three target adapters (one with a drafter adapter) and each one merged."""
    from conftest import make_pair

    root = tmp_path_factory.mktemp("served")
    target, draft = (Path(p) for p in make_pair(root))
    adapters = {name: make_adapter(target, root / name, seed=i + 1) for i, name in enumerate("abc")}
    merged = {name: str(merged_checkpoint(target, path, root / f"merged-{name}")) for name, path in adapters.items()}
    drafter_adapter = make_adapter(draft, root / "a-draft", seed=9)
    modules = [{"name": n, "path": str(p)} for n, p in adapters.items()]
    modules[0]["draft_path"] = str(drafter_adapter)
    return (str(target), str(draft)), modules, merged


def greedy(config, jobs: list[tuple[list[int], str | None]], max_tokens: int = 12) -> list[list[int]]:
    from minedraft.engine.engine import LLMEngine
    from minedraft.sampling.params import SamplingParams

    engine = LLMEngine.local(config)
    params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
    requests = [engine.add_request(p, params, lora=lora) for p, lora in jobs]
    while engine.has_unfinished():
        engine.step()
    return [r.output_ids for r in requests]


MODES = {"ar": None, "sd": {"num_speculative_tokens": 3},
         "minedraft": {"num_speculative_tokens": 3, "is_parallel": True}}


@pytest.mark.parametrize("mode", MODES)
def test_every_mode_equals_the_merged_target_alone(served, mode):
    """A batch mixing three adapters (a's drafter with its own adapter) and base requests: every request's
    greedy output is that of its merged target (or the base) alone."""
    from conftest import tiny_config

    pair, modules, merged = served
    config = tiny_config(pair, MODES[mode], enable_lora=True, lora_modules=modules, max_loras=3, max_num_seqs=4)
    names = ["a", None, "b", "c", "a", None]
    prompts = [tokens(6 + i, seed=20 + i) for i in range(len(names))]
    outputs = greedy(config, list(zip(prompts, names, strict=True)))
    for prompt, name, output in zip(prompts, names, outputs, strict=True):
        alone = tiny_config((merged[name], pair[1]) if name else pair)
        assert output == greedy(alone, [(prompt, None)])[0], name
    assert outputs[0] != greedy(tiny_config(pair), [(prompts[0], None)])[0], "the adapter changes the output"


def test_llm_generate_takes_one_lora_request_per_prompt(served):
    """LLM.generate(lora_request=[...]): one adapter (or None) per prompt, as vLLM takes them; each prompt gets
    what its adapter gives it alone."""
    from minedraft.llm import LLM, LoRARequest
    from minedraft.sampling.params import SamplingParams

    from conftest import tiny_config

    pair, modules, _ = served
    config = tiny_config(pair, MODES["sd"], enable_lora=True, lora_modules=modules, max_loras=3)
    prompts = [tokens(7 + i, seed=40 + i) for i in range(4)]
    names = ["a", None, "b", "a"]
    params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    with LLM(**config.model_dump(exclude_unset=True)) as llm:
        outputs = llm.generate(prompts, params, use_tqdm=False,
                               lora_request=[n and LoRARequest(n, i + 1) for i, n in enumerate(names)])
        with pytest.raises(ValueError, match="2 lora requests for 4 prompts"):
            llm.generate(prompts, params, use_tqdm=False, lora_request=["a", "b"])
    alone = greedy(config, list(zip(prompts, names, strict=True)), max_tokens=8)
    assert [list(o.outputs[0].token_ids) for o in outputs] == alone


def test_engine_refuses_unknown_adapter_and_drafter_adapter_with_eagle(served):
    from minedraft.engine.engine import LLMEngine
    from minedraft.sampling.params import SamplingParams

    from conftest import tiny_config

    pair, modules, _ = served
    engine = LLMEngine.local(tiny_config(pair, enable_lora=True, lora_modules=modules[1:]))
    with pytest.raises(ValueError, match="unknown LoRA adapter 'zzz'"):
        engine.add_request([5, 6, 7], SamplingParams(), lora="zzz")
    with pytest.raises(ValueError, match=r"draft_path.*not EAGLE heads, PARD \(parallel_drafting\)"):
        tiny_config(pair, {"num_speculative_tokens": 2, "parallel_drafting": True}, enable_lora=True,
                    lora_modules=modules)


BUNDLED = Path(__file__).resolve().parents[1] / "models"
DOMAIN = "idlelib"  # the shipped pair's domain (models/train.py --phase lora)


def test_shipped_lora_pair_serves_the_merged_target(tmp_path):
    """The shipped idlelib pair loads and serves: with the target adapter (its drafter adapter drafting) the greedy
    output is the PEFT-merged target's alone, and not the base target's."""
    from minedraft.model.tokenizer import load_tokenizer

    from conftest import tiny_config

    target, draft = BUNDLED / "minedraft-target", BUNDLED / "minedraft-draft"
    adapter, drafter = BUNDLED / f"minedraft-target-lora-{DOMAIN}", BUNDLED / f"minedraft-draft-lora-{DOMAIN}"
    merged = merged_checkpoint(target, adapter, tmp_path / "merged")
    tokenizer = load_tokenizer(str(target))
    rows = (BUNDLED / "prompts" / f"lora-{DOMAIN}.jsonl").read_text().splitlines()[:2]
    prompts = [tokenizer.encode(json.loads(row)["prompt"]) for row in rows]
    pair, spec = (str(target), str(draft)), {"num_speculative_tokens": 4, "adaptive": False}
    modules = [{"name": DOMAIN, "path": str(adapter), "draft_path": str(drafter)}]
    served = greedy(tiny_config(pair, spec, enable_lora=True, lora_modules=modules, max_model_len=512),
                    [(p, DOMAIN) for p in prompts], max_tokens=24)
    alone = greedy(tiny_config((str(merged), str(draft)), max_model_len=512), [(p, None) for p in prompts], 24)
    base = greedy(tiny_config(pair, max_model_len=512), [(p, None) for p in prompts], 24)
    assert served == alone
    assert served != base, "the shipped adapter must change the greedy output"
