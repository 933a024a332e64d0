"""Which request fields of OpenAI's API and vLLM's extras this server honours, refuses or ignores on purpose.

A request field is never silently ignored. The request models (`openai_protocol.py`) declare the fields that are
honoured; every other field a body carries is looked up here:

- set to what this server does anyway (the default it would take): accepted, since that is honoured;
- a known OpenAI or vLLM field set to anything else: refused by name with a 400 saying what is missing;
- one of `IGNORED` (OpenAI platform features with no effect on the output): accepted and ignored;
- anything else: refused as an unknown field.

docs/services.md lists the same tables for users.
"""

from __future__ import annotations

from typing import Any

# Fields that do not change what is generated, ignored on purpose: end-user ids and tags for OpenAI's own
# monitoring and storage, and its service tiers. Clients and SDKs send them by default.
IGNORED = frozenset({"user", "metadata", "store", "service_tier", "prompt_cache_key", "safety_identifier"})

_STRUCTURED = "grammars other than a JSON schema, a regex or a choice are not implemented"
_TOOLS = "the legacy functions API is not implemented: use tools and tool_choice"
_CHAT_TOOLS = "tool calls are for chat completions"
_ONE_SAMPLE = "no beam search"
# Known fields this server does not implement, with what is missing. Each is accepted only when set to the
# value in `_AS_DONE` (what this server does anyway) or to null.
NOT_IMPLEMENTED = {
    "guided_grammar": _STRUCTURED, "guided_decoding_backend": "the grammar backend is always xgrammar",
    "guided_whitespace_pattern": "JSON is always generated compact", "structural_tag": _STRUCTURED,
    "functions": _TOOLS, "function_call": _TOOLS, "tools": _CHAT_TOOLS, "tool_choice": _CHAT_TOOLS,
    "parallel_tool_calls": _CHAT_TOOLS,
    "use_beam_search": _ONE_SAMPLE, "length_penalty": _ONE_SAMPLE,
    "prompt_logprobs": "prompt logprobs are returned by the completions endpoint only",
    "allowed_token_ids": "allowed_token_ids is not implemented",
    "logits_processors": "custom logits processors are not implemented",
    "include_stop_str_in_output": "stop strings are always left out of the output",
    "skip_special_tokens": "special tokens are always left out of the text",
    "spaces_between_special_tokens": "special tokens are always left out of the text",
    "truncate_prompt_tokens": "prompts are never truncated (a prompt too long is refused)",
    "add_special_tokens": "special tokens are added to a completion's prompt and not to a rendered chat",
    "continue_final_message": "the final message cannot be continued", "documents": "documents are not implemented",
    "chat_template": "the model's own chat template is used", "mm_processor_kwargs": "this model takes text only",
    "audio": "this model takes text only", "modalities": "this model takes text only",
    "web_search_options": "web search is not implemented",
    "reasoning_effort": "reasoning options are not implemented", "verbosity": "verbosity is not implemented",
    "return_tokens_as_token_ids": "not implemented", "return_token_ids": "not implemented",
    "prompt_embeds": "prompt embeddings are not implemented", "priority": "request priorities are not implemented",
    "request_id": "not implemented (the server names each request)", "cache_salt": "not implemented",
    "kv_transfer_params": "not implemented", "vllm_xargs": "not implemented",
    "echo": "echo is not implemented", "suffix": "suffix is not implemented",
    "refusal": "not implemented",
}  # fmt: skip
# The values of those fields that describe what this server does anyway (besides null).
_AS_DONE: dict[str, tuple[Any, ...]] = {
    "tool_choice": ("none", "auto"), "parallel_tool_calls": (True, False), "use_beam_search": (False,),
    "include_stop_str_in_output": (False,), "skip_special_tokens": (True,), "spaces_between_special_tokens": (True,),
    "continue_final_message": (False,), "return_tokens_as_token_ids": (False,), "return_token_ids": (False,),
    "priority": (0,), "length_penalty": (1, 1.0), "echo": (False,), "guided_decoding_backend": ("xgrammar", "auto"),
}  # fmt: skip


def refusals(extra: dict[str, Any], add_special_tokens: bool, prefix: str = "") -> list[tuple[str, str]]:
    """(field, why) for each field of `extra` (what the request model did not declare) that is refused.
    `add_special_tokens`: what this endpoint does (a completion's prompt gets them, a rendered chat not);
    `prefix`: where the fields sit in the body (a message's)."""
    refused = []
    for name, value in extra.items():
        done = (add_special_tokens,) if name == "add_special_tokens" else _AS_DONE.get(name, ())
        if name in IGNORED or value is None or value == [] or (name in NOT_IMPLEMENTED and _same(value, done)):
            continue
        refused.append((prefix + name, NOT_IMPLEMENTED.get(name, "unknown field")))
    return refused


def _same(value: Any, allowed: tuple[Any, ...]) -> bool:
    """`value` is one of `allowed`, type included (true is not 1)."""
    return any(type(value) is type(a) and value == a for a in allowed)
