"""Resuming a Generate request whose stream broke after some of its tokens: one rule for the gateway (a request
migrated to another engine group) and the client SDK (a stream resubmitted after the gateway or scheduler died).

The tokens already streamed are sent back as the end of the prompt, marked `resumed_tokens`: they count as output
for min_tokens, the penalties and the position of each random draw (keyed by seed and output position), so with
the same seed the rest of the output is what one uninterrupted run would have produced.
"""

from __future__ import annotations

from collections.abc import Sequence

from minedraft.api import generate_pb2 as pb

DEFAULT_MAX_TOKENS = 16  # SamplingParameters.max_tokens when unset


def resume_request(
    original: pb.GenerateRequest, prompt_ids: Sequence[int], output_ids: Sequence[int]
) -> pb.GenerateRequest:
    """`original` (its prompt as `prompt_ids`) continued after `output_ids`: prompt + output as the prompt, the
    remaining max_tokens, the same seed and options. The prompt's logprobs came with the first tokens: not asked
    again."""
    request = pb.GenerateRequest()
    request.CopyFrom(original)
    request.prompt_token_ids.ids[:] = [*prompt_ids, *output_ids]  # replaces a text prompt (the oneof)
    sampling, produced = request.sampling, len(output_ids)
    if produced:
        max_tokens = sampling.max_tokens if sampling.HasField("max_tokens") else DEFAULT_MAX_TOKENS
        sampling.max_tokens = max_tokens - produced
        sampling.resumed_tokens += produced
        sampling.ClearField("prompt_logprobs")
    return request
