"""What a scheduler's GetServerInfo tells: its engine's config and limits, as its step loop holds them."""

from __future__ import annotations

import functools
import json
from pathlib import Path

from minedraft.api import generate_pb2
from minedraft.engine.engine import LLMEngine
from minedraft.model.config import load_model_config
from minedraft.version import __version__


def server_info(
    engine: LLMEngine, max_waiting: int, speculation: dict | None, lora_adapters: list[str]
) -> generate_pb2.ServerInfo:
    """`max_waiting`: the frontends' admission limit; `speculation`: what adaptive speculation chose last."""
    config = engine.config
    spec = config.speculative_config
    num_kv_blocks, kv_block_size = engine.kv_pool or (0, 0)
    return generate_pb2.ServerInfo(
        version=__version__,
        target_model=str(config.target_path),
        draft_model=str(config.draft_path) if spec else "",
        mode=config.mode.value,
        speculative_config_json=json.dumps(spec.model_dump(exclude_none=True)) if spec else "",
        tensor_parallel_size=config.tensor_parallel_size,
        max_num_seqs=config.max_num_seqs,
        max_model_len=engine.max_model_len,
        max_waiting_requests=max_waiting,
        vocab_size=engine.tokenizer.vocab_size,
        num_kv_blocks=num_kv_blocks,
        kv_block_size=kv_block_size,
        max_num_batched_tokens=config.max_num_batched_tokens,
        draft_method=spec.draft_method if spec else "",
        enable_prefix_caching=config.enable_prefix_caching,
        quantization=checkpoint_quantization(config.target_path),
        draft_quantization=checkpoint_quantization(config.draft_path) if spec else "",
        speculation_json=json.dumps(speculation) if speculation else "",
        lora_adapters=lora_adapters,
    )


@functools.cache
def checkpoint_quantization(path: Path) -> str:
    """The checkpoint's quantization as GetServerInfo reports it (the folder is read once)."""
    quant = load_model_config(path).quantization
    return quant.describe() if quant else ""
