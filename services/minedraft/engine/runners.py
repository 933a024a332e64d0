"""The workers' models, built from an EngineConfig: the target's runner and the drafter's worker (a draft model, an
EAGLE head, or a drafter without a model), with the options every runner shares.

The in-process executor (engine/local_executor.py), the verifier ranks and the drafters of the services build
their models here, so one config builds the same models wherever they run.
"""

from __future__ import annotations

from typing import Any

from minedraft.config import EngineConfig
from minedraft.engine.eagle_drafter import EagleDraftWorker
from minedraft.engine.lookup_drafter import LookupDraftWorker
from minedraft.engine.workers import DraftWorker
from minedraft.model.checkpoint import resolve_checkpoint
from minedraft.model.config import ModelConfig, load_model_config
from minedraft.model.eagle import EAGLE, EAGLE3, default_aux_layers, eagle_head_kind
from minedraft.model.lora import LoraOptions
from minedraft.model.runner import ModelRunner


def max_model_len(config: EngineConfig) -> int:
    """The longest sequence a worker holds: max_model_len, else the target's context length."""
    return config.max_model_len or load_model_config(config.target_path).max_position_embeddings


def target_runner(config: EngineConfig, num_slots: int, device: str, tp_group=None) -> ModelRunner:
    """The target model (a tensor-parallel rank's shard, with `tp_group`)."""
    return ModelRunner(
        config.target_path,
        num_slots=num_slots,
        max_seq_len=max_model_len(config),
        device=device,
        dtype=config.resolved_dtype(device),
        tp_group=tp_group,
        batch_invariant=config.batch_invariant,
        **target_options(config),
    )


def build_drafter(config: EngineConfig, num_slots: int, max_len: int, device: str,
                  target: ModelConfig | None = None) -> DraftWorker:  # fmt: skip
    """The drafter's worker: one that looks its drafts up (method ngram, suffix), or the draft model's (checked
    against the target's vocabulary, where given)."""
    if config.drafts_without_model:
        return LookupDraftWorker(config.speculative_config, max_len, config.draft_support_size)  # type: ignore[arg-type]
    runner = draft_runner(config, num_slots, max_len, device)
    if target is not None:
        check_compatible(target, runner.config)
    return draft_worker(config, runner)


def draft_runner(config: EngineConfig, num_slots: int, max_len: int, device: str) -> ModelRunner:
    """The draft model. Its logits need not be batch-shape invariant (whatever it proposes, the output is
    exactly the target's), so it always uses the fast kernels. An EAGLE head reads the target's
    tokenizer and embedding (an EAGLE-1 head: and LM head), and keeps no prefix cache: it writes each
    position from the target's features, which the verifier hands on for every position, those of a prefix
    it took from its cache included."""
    options = runner_options(config)
    if config.uses_eagle_head:
        check_eagle_head(config)
        options.update(target_path=config.target_path, enable_prefix_caching=False)
    drafter_adapters = {m.name: m.draft_path for m in config.lora_modules if m.draft_path}
    if drafter_adapters or config.allow_runtime_lora_updating and takes_drafter_adapters(config):
        options.update(lora=lora_options(config, drafter_adapters))  # run-time loads may bring drafter adapters
    return ModelRunner(
        config.draft_path,
        num_slots=num_slots,
        max_seq_len=max_len,
        device=device,
        dtype=config.resolved_dtype(device),
        batch_invariant=False,
        **options,
    )


def draft_worker(config: EngineConfig, runner: ModelRunner) -> DraftWorker:
    """The drafter's worker; with parallel_drafting, it drafts with the mask token the checkpoint names."""
    if config.uses_eagle_head:
        parallel = config.speculative_config is not None and config.speculative_config.parallel_drafting
        return EagleDraftWorker(runner, support_size=config.draft_support_size, parallel=parallel)
    mask_token = None
    if config.speculative_config is not None and config.speculative_config.parallel_drafting:
        mask_token = runner.config.pard_token
        if mask_token is None:
            raise ValueError(
                f"parallel_drafting needs a draft model trained for it (PARD): {config.draft_path}/config.json "
                "names no pard_token"
            )
    return DraftWorker(runner, support_size=config.draft_support_size, mask_token=mask_token)


def target_options(config: EngineConfig) -> dict[str, Any]:
    """The target's runner: with an EAGLE drafter it keeps the features the head reads; with LoRA, the
    adapters of lora_modules."""
    options = runner_options(config)
    if config.uses_eagle_head:
        options.update(aux_hidden_layers=eagle_aux_layers(config))
    if config.enable_lora:
        options.update(lora=lora_options(config, {m.name: m.path for m in config.lora_modules}))
    return options


def takes_drafter_adapters(config: EngineConfig) -> bool:
    """Whether the drafter can apply LoRA adapters of its own: a draft model does; EAGLE heads and PARD do not."""
    spec = config.speculative_config
    return (spec is not None and not config.uses_eagle_head and not spec.parallel_drafting
            and not spec.drafts_without_model)  # fmt: skip


def lora_options(config: EngineConfig, adapters: dict[str, str]) -> LoraOptions:
    return LoraOptions(adapters, config.max_loras, config.max_lora_rank, config.max_cpu_loras)


def eagle_aux_layers(config: EngineConfig) -> tuple[int, ...]:
    """The target's hidden states the EAGLE head reads (ModelRunner's aux_hidden_layers): an EAGLE-1 head the
    last one after the final norm; an EAGLE-3 head the inputs of the layers its config names, else the usual
    three."""
    head = check_eagle_head(config)
    target_layers = load_model_config(config.target_path).num_hidden_layers
    if config.speculative_config.method == EAGLE:  # type: ignore[union-attr] (checked above)
        return (target_layers,)
    return head.aux_hidden_layers or default_aux_layers(target_layers)


def check_eagle_head(config: EngineConfig) -> ModelConfig:
    """The head's config, once its folder shows the kind of head the method names (model/eagle.py)."""
    assert config.speculative_config is not None
    head, method = load_model_config(config.draft_path), config.speculative_config.method
    kind = eagle_head_kind(resolve_checkpoint(config.draft_path), head)
    if kind != method:
        name = {EAGLE: "EAGLE-1", EAGLE3: "EAGLE-3"}
        layout = {EAGLE: "LlamaForCausalLM, fc.weight, no model.* weights", EAGLE3: "LlamaForCausalLMEagle3"}
        what = (f"an {name[kind]} head (use method {kind})" if kind else
                f"a {head.architecture} checkpoint without that layout ({layout.get(method, '')})")  # fmt: skip
        raise ValueError(f"method {method} needs an {name.get(method, method)} head: {config.draft_path} is {what}")
    return head


def runner_options(config: EngineConfig) -> dict[str, Any]:
    """The settings every worker's runner shares: how it sizes and keeps its paged KV cache (drafter and
    verifier alike, so the engine can admit by the smaller of the two pools), and how it launches steps."""
    return {
        "enforce_eager": config.enforce_eager,
        "block_size": config.block_size,
        "kv_cache_memory_bytes": config.kv_cache_memory_bytes,
        "gpu_memory_utilization": config.gpu_memory_utilization,
        "enable_prefix_caching": config.enable_prefix_caching,
        "tokenizer": config.tokenizer,
    }


def check_compatible(target: ModelConfig, draft: ModelConfig) -> None:
    """Drafts are token ids of the target's vocabulary: the two models must share it."""
    if target.vocab_size != draft.vocab_size:
        raise ValueError(
            f"draft vocabulary ({draft.vocab_size} tokens) differs from the target's ({target.vocab_size}): "
            "the draft model must use the target's tokenizer"
        )
