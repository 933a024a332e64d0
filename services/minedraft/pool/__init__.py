"""A drafter pool: drafters that serve several engine groups, and the groups' side of binding to one."""

from __future__ import annotations

from minedraft.config import EngineConfig


def check_poolable(config: EngineConfig) -> None:
    """What a pool drafter cannot serve, refused by name."""
    spec = config.speculative_config
    if spec is None:
        raise ValueError("a drafter pool drafts for speculative decoding: give --speculative-config")
    if config.uses_eagle_head:
        raise ValueError(
            f"method {spec.method} cannot use a drafter pool: an EAGLE head reads the target's hidden states every "
            "step, and a pool drafter is reached over the network; keep it with its group (no --drafter-pool)"
        )
    if config.enable_lora:
        raise ValueError("a drafter pool does not serve LoRA adapters: serve them with a drafter per group "
                         "(no --drafter-pool)")  # fmt: skip
