"""A request's prompt and parameters against the bounds the model sets, and its words (bad words, a prediction)
as the target tokenizes them: what `LLMEngine.make_request` checks before a request reaches any step (the static
bounds are SamplingParams')."""

from __future__ import annotations

from typing import Protocol

from minedraft.config import EngineConfig
from minedraft.engine.detokenizer import Decoder
from minedraft.extras import require
from minedraft.sampling.params import SamplingParams, StructuredOutputs


class ModelBounds(Protocol):
    """What the checks read of an engine: settings fixed at start (the gateway's RoutedEngine has them too, once a
    group told them)."""

    @property
    def max_model_len(self) -> int: ...

    @property
    def tokenizer(self) -> Decoder: ...

    @property
    def config(self) -> EngineConfig: ...


def check_request(engine: ModelBounds, prompt_ids: list[int], params: SamplingParams) -> None:
    """The bounds that depend on the model; ValueError naming the field and its range. Reads only settings fixed at
    start, so the frontends may call it from another thread."""
    if not prompt_ids:
        raise ValueError("prompt is empty: it must contain at least one token")
    if len(prompt_ids) >= engine.max_model_len:
        raise ValueError(f"prompt has {len(prompt_ids)} tokens but max_model_len is {engine.max_model_len}: no room "
                         "is left for output")  # fmt: skip
    vocab_size = getattr(engine.tokenizer, "vocab_size", None)
    if vocab_size is not None:
        _check_vocabulary(prompt_ids, params, vocab_size)
    if params.resumed_tokens >= len(prompt_ids):
        raise ValueError(f"resumed_tokens: must be less than the prompt's {len(prompt_ids)} tokens (at least one "
                         f"is prompt); got {params.resumed_tokens}")  # fmt: skip
    max_k = engine.config.max_k
    if params.num_speculative_tokens is not None and params.num_speculative_tokens > max_k:
        raise ValueError(f"num_speculative_tokens: must be in [0, {max_k}] (the server's num_speculative_tokens); "
                         f"got {params.num_speculative_tokens}")  # fmt: skip
    if params.max_tokens > engine.max_model_len:
        raise ValueError(f"max_tokens: must be in [1, {engine.max_model_len}] (max_model_len); got {params.max_tokens}")
    if params.structured_outputs is not None:
        check_structured_outputs(params.structured_outputs)


def _check_vocabulary(prompt_ids: list[int], params: SamplingParams, vocab_size: int) -> None:
    if any(not 0 <= t < vocab_size for t in prompt_ids):
        raise ValueError(f"prompt: token ids must be in [0, {vocab_size})")
    if any(t >= vocab_size for t in params.stop_token_ids):
        raise ValueError(f"stop_token_ids: token ids must be in [0, {vocab_size})")
    if any(t >= vocab_size for t in params.logit_bias):
        raise ValueError(f"logit_bias: token ids must be in [0, {vocab_size})")
    if params.top_k > vocab_size:
        raise ValueError(f"top_k: must be -1 (all) or in [1, {vocab_size}] (the vocabulary size)")


def check_structured_outputs(structured: StructuredOutputs) -> None:
    """ValueError when the grammar library is not installed or the schema or regex is malformed."""
    require("xgrammar", "structured output on this server")
    # xgrammar is optional: sampling.grammar is imported only when a request asks for a grammar
    from minedraft.sampling.grammar import check_grammar

    check_grammar(structured)


def bad_words_ids(tokenizer: Decoder, words: list[str]) -> list[list[int]]:
    """Each bad word as the target tokenizes it, without and with a leading space (as vLLM does): the workers ban
    by token sequences."""
    if words and not hasattr(tokenizer, "encode"):
        raise ValueError("bad_words: this engine has no tokenizer to turn them into tokens")
    variants = [tokenizer.encode(text, add_special_tokens=False) for word in words
                for text in (word.lstrip(), " " + word.lstrip())]  # fmt: skip
    return [ids for i, ids in enumerate(variants) if ids and ids not in variants[:i]]


def prediction_ids(engine: ModelBounds, prediction: str | None) -> list[int]:
    """The prediction as the target tokenizes it (the drafter proposes its tokens), within the bounds."""
    if not prediction:
        return []
    if not hasattr(engine.tokenizer, "encode"):
        raise ValueError("prediction: this engine has no tokenizer to turn it into tokens")
    ids = engine.tokenizer.encode(prediction, add_special_tokens=False)
    most = min(engine.config.max_prediction_tokens, engine.max_model_len)
    if len(ids) > most:
        which = "max_prediction_tokens" if most == engine.config.max_prediction_tokens else "max_model_len"
        raise ValueError(f"prediction: {len(ids)} tokens is more than this server takes ({most}, its {which})")
    return ids
