"""Per-request sampling parameters, shaped like vLLM's."""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict, Field, field_validator

# Temperatures below this are treated as greedy (argmax), as in vLLM.
GREEDY_EPSILON = 1e-5


class SamplingParams(BaseModel):
    """How to pick tokens and when to stop. ``temperature=0`` means greedy decoding."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    temperature: float = Field(1.0, ge=0.0, description="0 = greedy; higher = more random.")
    top_p: float = Field(1.0, gt=0.0, le=1.0, description="Keep the smallest set of tokens with this mass.")
    top_k: int = Field(-1, description="Keep the k most likely tokens; -1 = all.")
    seed: int | None = Field(None, description="Seed of this request's random stream.")
    max_tokens: int = Field(16, ge=1, description="Most tokens to generate.")
    stop: list[str] = Field(default_factory=list, description="Stop when the text contains one of these.")
    stop_token_ids: list[int] = Field(default_factory=list, description="Stop after one of these tokens.")
    ignore_eos: bool = Field(False, description="Keep generating past the end-of-sequence token.")

    def __init__(self, temperature: float = 1.0, top_p: float = 1.0, top_k: int = -1, **kwargs) -> None:
        # Positional order as in vLLM: SamplingParams(temperature, top_p, top_k, ...).
        super().__init__(temperature=temperature, top_p=top_p, top_k=top_k, **kwargs)

    @field_validator("top_k")
    @classmethod
    def _check_top_k(cls, value: int) -> int:
        if value == 0 or value < -1:
            raise ValueError("top_k must be -1 (disabled) or a positive integer")
        return value

    @field_validator("stop", "stop_token_ids", mode="before")
    @classmethod
    def _none_or_one_to_list(cls, value):
        if value is None:
            return []
        if isinstance(value, (str, int)):
            return [value]
        return value

    @field_validator("stop")
    @classmethod
    def _check_stop(cls, value: list[str]) -> list[str]:
        if any(s == "" for s in value):
            raise ValueError("stop strings must not be empty")
        return value

    @property
    def greedy(self) -> bool:
        return self.temperature < GREEDY_EPSILON
