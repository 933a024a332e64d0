"""Per-request sampling parameters, shaped like vLLM's.

Every field is bounded by what the engine can honour end to end: the values travel to the workers as
protobuf (temperature and top_p as float32, top_k and max_tokens as int32, the seed as uint64, stop
token ids as uint32), so a value the wire cannot carry exactly is refused here, naming the field and its
range, before it reaches any step. Types are strict: a bool is not an int, a string is not a number.
Bounds that depend on the model (token ids below the vocabulary, max_tokens within the context) are the
engine's to check (`LLMEngine.check_request`).

Penalties, biases, bad words, min_p, min_tokens and logprobs have vLLM's names and meanings (see
`sampling/penalties.py` for how they change the logits, `sampling/logprobs.py` for what logprobs are);
each changes the target distribution, and speculative decoding samples exactly from the changed one.
Structured output (`StructuredOutputs`, as vLLM's `structured_outputs`) restricts every position to the
tokens a grammar allows there (`sampling/grammar.py`).
"""

from __future__ import annotations

import json
import math
import struct
from dataclasses import dataclass
from typing import Annotated

from pydantic import (
    AfterValidator,
    BaseModel,
    ConfigDict,
    Field,
    StrictBool,
    StrictFloat,
    StrictInt,
    field_validator,
    model_validator,
)

# Temperatures below this are treated as greedy (argmax), as in vLLM.
GREEDY_EPSILON = 1e-5
INT32_MAX = 2**31 - 1
UINT32_MAX = 2**32 - 1
UINT64_MAX = 2**64 - 1
MAX_LOGPROBS = 20  # most likely tokens returned per output token, at most (as vLLM's default max_logprobs)


def as_float32(value: float) -> float:
    """The value the wire carries (float32): what the workers will see of a float the client sent."""
    try:
        return struct.unpack("f", struct.pack("f", value))[0]
    except OverflowError:
        return math.copysign(math.inf, value)


def check_float32(value: float) -> float:
    if math.isinf(as_float32(value)):
        raise ValueError(f"{value!r} is outside the float32 range the engine computes in")
    return value


def check_unicode(value: str) -> str:
    """Text must be valid Unicode: a lone UTF-16 surrogate (a JSON escape like \\ud800) cannot be encoded."""
    try:
        value.encode("utf-8")
    except UnicodeEncodeError as exc:
        raise ValueError(
            f"contains a lone UTF-16 surrogate {value[exc.start]!r} at index {exc.start}: not valid Unicode"
        ) from None
    return value


Float32 = Annotated[StrictFloat, Field(allow_inf_nan=False), AfterValidator(check_float32)]
Text = Annotated[str, Field(strict=True), AfterValidator(check_unicode)]
TokenId = Annotated[StrictInt, Field(ge=0, le=UINT32_MAX)]
Bias = Annotated[StrictFloat, Field(ge=-100, le=100, allow_inf_nan=False)]


class StructuredOutputs(BaseModel):
    """What the output must match, as vLLM's `structured_outputs` (exactly one of the fields): a JSON schema,
    any JSON object, a regular expression, or one of a list of strings."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    json_schema: Text | None = Field(None, alias="json", description="A JSON schema (an object or its JSON text).")
    regex: Text | None = Field(None, description="A regular expression the whole output matches.")
    choice: tuple[Text, ...] | None = Field(None, description="The output is exactly one of these strings.")
    json_object: StrictBool = Field(False, description="The output is a JSON object (any).")

    @field_validator("json_schema", mode="before")
    @classmethod
    def _schema_as_text(cls, value):
        return json.dumps(value) if isinstance(value, dict) else value

    @field_validator("choice")
    @classmethod
    def _check_choice(cls, value: tuple[str, ...] | None) -> tuple[str, ...] | None:
        if value is not None and (not value or any(c == "" for c in value)):
            raise ValueError("choice must hold at least one string, none of them empty")
        return value

    @model_validator(mode="after")
    def _exactly_one(self) -> StructuredOutputs:
        given = [kind for kind, _ in self._given()]
        if len(given) != 1:
            raise ValueError(f"give exactly one of json, regex, choice, json_object (got {', '.join(given) or 'none'})")
        return self

    def _given(self) -> list[tuple[str, str | tuple[str, ...] | bool]]:
        fields = (("json", self.json_schema), ("regex", self.regex), ("choice", self.choice),
                  ("json_object", self.json_object or None))  # fmt: skip
        return [(kind, value) for kind, value in fields if value is not None]

    @property
    def key(self) -> tuple[str, str | tuple[str, ...] | bool]:
        """(kind, source): what a compiled grammar is cached by."""
        return self._given()[0]


@dataclass(frozen=True)
class TokenLogprob:
    """One output token's log-probability and the `SamplingParams.logprobs` most likely tokens' (best first)."""

    logprob: float
    top_ids: list[int]
    top_logprobs: list[float]
    rank: int | None = None  # the token's rank in its distribution (1: the most likely); prompt logprobs only


class SamplingParams(BaseModel):
    """How to pick tokens and when to stop. ``temperature=0`` means greedy decoding."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    temperature: Float32 = Field(1.0, description="0 = greedy; higher = more random.")
    top_p: Float32 = Field(1.0, description="Keep the smallest set of tokens with this mass, in (0, 1].")
    top_k: StrictInt = Field(-1, ge=-1, le=INT32_MAX, description="Keep the k most likely tokens; -1 = all.")
    seed: StrictInt | None = Field(None, ge=0, le=UINT64_MAX, description="Seed of this request's random stream.")
    max_tokens: StrictInt = Field(16, ge=1, le=INT32_MAX, description="Most tokens to generate.")
    stop: list[Text] = Field(default_factory=list, description="Stop when the text contains one of these.")
    stop_token_ids: list[TokenId] = Field(default_factory=list, description="Stop after one of these tokens.")
    ignore_eos: StrictBool = Field(False, description="Keep generating past the end-of-sequence token.")
    presence_penalty: Float32 = Field(0.0, ge=-2.0, le=2.0, description="Subtracted from the logit of every token "
                                      "the output holds already.")  # fmt: skip
    frequency_penalty: Float32 = Field(0.0, ge=-2.0, le=2.0, description="Subtracted from a token's logit once per "
                                       "time the output holds it.")  # fmt: skip
    repetition_penalty: Float32 = Field(1.0, gt=0.0, description="Divides the positive logits (multiplies the "
                                        "negative ones) of tokens in the prompt or the output; 1 = off.")  # fmt: skip
    logit_bias: dict[TokenId, Bias] = Field(default_factory=dict, description="Added to the logits of these token "
                                            "ids, in [-100, 100].")  # fmt: skip
    min_p: Float32 = Field(0.0, ge=0.0, le=1.0, description="Drop tokens less likely than min_p x the most "
                           "likely one's probability; 0 = off.")  # fmt: skip
    logprobs: StrictInt | None = Field(None, ge=0, le=MAX_LOGPROBS, description="Return each output token's "
                                       "log-probability and this many most likely tokens'; None = none.")  # fmt: skip
    prompt_logprobs: StrictInt | None = Field(None, ge=0, le=MAX_LOGPROBS, description="Return each prompt "
                                              "token's log-probability given the tokens before it (None for the "
                                              "first) and this many most likely tokens'; None = none.")  # fmt: skip
    bad_words: list[Text] = Field(default_factory=list, description="Words the output must not contain: the last "
                                  "token of each (as it tokenizes with and without a leading space) is banned where "
                                  "the output ends with the ones before it.")  # fmt: skip
    min_tokens: StrictInt = Field(0, ge=0, le=INT32_MAX, description="Generate at least this many tokens before "
                                  "EOS, a stop token or a stop string may end the output.")  # fmt: skip
    resumed_tokens: StrictInt = Field(0, ge=0, le=INT32_MAX, description="The prompt's last resumed_tokens are "
                                      "output an earlier run of this request already produced (the gateway sets it "
                                      "when it moves a request to another group): min_tokens, the presence and "
                                      "frequency penalties and bad words count them as output.")  # fmt: skip
    num_speculative_tokens: StrictInt | None = Field(None, ge=0, le=INT32_MAX, description="The most tokens this "
                                                     "request may draft per verification (0 = decode it plainly); "
                                                     "at most the server's num_speculative_tokens. None = the "
                                                     "server's choice.")  # fmt: skip
    structured_outputs: StructuredOutputs | None = Field(None, description="A grammar the output follows (a JSON "
                                                         "schema, a regex, a choice); None = free text.")  # fmt: skip
    prediction: Text | None = Field(None, description="The text the output is expected to be, or mostly be (OpenAI's "
                                    "Predicted Outputs, e.g. a file being edited): drafts are taken from it where "
                                    "the output follows it. It never changes the output, only how fast it "
                                    "comes.")  # fmt: skip

    def __init__(self, temperature: float = 1.0, top_p: float = 1.0, top_k: int = -1, **kwargs) -> None:
        # Positional order as in vLLM: SamplingParams(temperature, top_p, top_k, ...).
        super().__init__(temperature=temperature, top_p=top_p, top_k=top_k, **kwargs)

    @field_validator("temperature")
    @classmethod
    def _check_temperature(cls, value: float) -> float:
        if value < 0:
            raise ValueError("temperature must be >= 0 (0 = greedy)")
        return value

    @field_validator("top_p")
    @classmethod
    def _check_top_p(cls, value: float) -> float:
        if not 0.0 < as_float32(value) <= 1.0:
            raise ValueError("top_p must be in (0, 1] (as a float32)")
        return value

    @field_validator("top_k")
    @classmethod
    def _check_top_k(cls, value: int) -> int:
        if value == 0:
            raise ValueError("top_k must be -1 (disabled) or a positive integer")
        return value

    @field_validator("stop", "stop_token_ids", "bad_words", mode="before")
    @classmethod
    def _none_or_one_to_list(cls, value):
        if value is None:
            return []
        if isinstance(value, (str, int)) and not isinstance(value, bool):
            return [value]
        return value

    @field_validator("stop")
    @classmethod
    def _check_stop(cls, value: list[str]) -> list[str]:
        if any(s == "" for s in value):
            raise ValueError("stop strings must not be empty")
        return value

    @field_validator("bad_words")
    @classmethod
    def _check_bad_words(cls, value: list[str]) -> list[str]:
        if any(not word.strip() for word in value):
            raise ValueError("bad words must not be empty or only spaces")
        return value

    @field_validator("logit_bias", mode="before")
    @classmethod
    def _none_to_dict(cls, value):
        return {} if value is None else value

    @model_validator(mode="after")
    def _check_min_tokens(self) -> SamplingParams:
        if self.min_tokens > self.max_tokens:
            raise ValueError(f"min_tokens ({self.min_tokens}) must be at most max_tokens ({self.max_tokens})")
        return self

    @model_validator(mode="after")
    def _check_structured(self) -> SamplingParams:
        if self.structured_outputs is not None and (self.ignore_eos or self.min_tokens):
            raise ValueError("structured_outputs cannot be combined with ignore_eos or min_tokens: the grammar ends "
                             "the output with EOS once it is complete")  # fmt: skip
        return self

    @property
    def penalized(self) -> bool:
        """Whether the logits change before temperature: penalties, biases, min_tokens or bad words."""
        return bool(self.presence_penalty or self.frequency_penalty or self.repetition_penalty != 1.0
                    or self.logit_bias or self.min_tokens or self.bad_words)  # fmt: skip

    @property
    def greedy(self) -> bool:
        return self.temperature < GREEDY_EPSILON
