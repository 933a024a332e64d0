"""Translation between protobuf messages and the engine's types: the one place services convert."""

from __future__ import annotations

from pydantic import ValidationError

from minedraft.api import generate_pb2, worker_pb2
from minedraft.config import LoraModule
from minedraft.engine.plans import (
    Admission,
    DraftPlan,
    Drafts,
    DraftTask,
    LoraChange,
    PrefillTask,
    StepResult,
    Verified,
    VerifyPlan,
    VerifyTask,
)
from minedraft.engine.request import SpecDecodeStats
from minedraft.engine.step import StepPlan, merge_loaded
from minedraft.sampling.params import SamplingParams, StructuredOutputs, TokenLogprob

_FIELDS = ("temperature", "top_p", "top_k", "seed", "max_tokens", "presence_penalty", "frequency_penalty",
           "repetition_penalty", "min_p", "min_tokens", "logprobs", "resumed_tokens", "prompt_logprobs",
           "num_speculative_tokens", "prediction")  # fmt: skip
FINISH_REASONS = {"stop": generate_pb2.FINISH_REASON_STOP, "length": generate_pb2.FINISH_REASON_LENGTH}
_REASON_NAMES = {value: name for name, value in FINISH_REASONS.items()}


def describe_validation_error(exc: ValidationError) -> str:
    """'temperature: Input should be greater than or equal to 0' rather than pydantic's long form."""
    return "; ".join(f"{'.'.join(str(p) for p in e['loc']) or 'value'}: {e['msg']}" for e in exc.errors())


def finish_reason_to_proto(reason: str | None) -> int:
    return FINISH_REASONS.get(reason or "", generate_pb2.FINISH_REASON_UNSPECIFIED)


def finish_reason_from_proto(value: int) -> str:
    return _REASON_NAMES.get(value, "stop")


def sampling_from_proto(msg: generate_pb2.SamplingParameters) -> SamplingParams:
    """Unset fields take SamplingParams' defaults; raises pydantic.ValidationError on bad values."""
    kwargs = {name: getattr(msg, name) for name in _FIELDS if msg.HasField(name)}
    structured = structured_from_proto(msg.structured_outputs) if msg.HasField("structured_outputs") else None
    return SamplingParams(
        **kwargs, stop=list(msg.stop), stop_token_ids=list(msg.stop_token_ids), ignore_eos=msg.ignore_eos,
        logit_bias=dict(msg.logit_bias), bad_words=list(msg.bad_words),
        structured_outputs=structured,
    )


def structured_from_proto(msg: generate_pb2.StructuredOutputs) -> dict:
    """The fields the message sets, for StructuredOutputs to validate (exactly one)."""
    given = {name: getattr(msg, name) for name in ("json", "regex") if msg.HasField(name)}
    if msg.choice:
        given["choice"] = list(msg.choice)
    if msg.json_object:
        given["json_object"] = True
    return given


def structured_to_proto(structured: StructuredOutputs | None) -> generate_pb2.StructuredOutputs | None:
    if structured is None:
        return None
    return generate_pb2.StructuredOutputs(json=structured.json_schema, regex=structured.regex,
                                          choice=structured.choice or (),
                                          json_object=structured.json_object)  # fmt: skip


def sampling_to_proto(params: SamplingParams) -> generate_pb2.SamplingParameters:
    """Field by field: the proto's SamplingParameters and SamplingParams have the same fields by name."""
    plain = {name: getattr(params, name) for name in SamplingParams.model_fields if name != "structured_outputs"}
    return generate_pb2.SamplingParameters(**plain, structured_outputs=structured_to_proto(params.structured_outputs))


def logprobs_to_proto(logprobs: list[TokenLogprob] | None) -> list[generate_pb2.TokenLogprob]:
    return [generate_pb2.TokenLogprob(logprob=t.logprob, top_ids=t.top_ids, top_logprobs=t.top_logprobs, rank=t.rank)
            for t in logprobs or []]  # fmt: skip


def logprobs_from_proto(msgs) -> list[TokenLogprob] | None:
    """None for an empty list: a request that asked for logprobs gets one per token."""
    return [TokenLogprob(m.logprob, list(m.top_ids), list(m.top_logprobs), m.rank if m.HasField("rank") else None)
            for m in msgs] or None  # fmt: skip


def stats_from_proto(msg: generate_pb2.SpecDecodeStats) -> SpecDecodeStats:
    return SpecDecodeStats(
        msg.num_drafts, msg.num_draft_tokens, msg.num_accepted_tokens, list(msg.num_accepted_tokens_per_pos)
    )


def stats_to_proto(stats: SpecDecodeStats) -> generate_pb2.SpecDecodeStats:
    return generate_pb2.SpecDecodeStats(
        num_drafts=stats.num_drafts,
        num_draft_tokens=stats.num_draft_tokens,
        num_accepted_tokens=stats.num_accepted_tokens,
        num_accepted_tokens_per_pos=stats.num_accepted_tokens_per_pos,
    )


def admission_to_proto(admission: Admission) -> worker_pb2.Admission:
    return worker_pb2.Admission(
        request_id=admission.request_id,
        token_ids=admission.token_ids,
        # The workers draft from the prediction's tokens: its text stays with the scheduler.
        sampling=sampling_to_proto(admission.params.model_copy(update={"prediction": None})),
        seed=admission.seed,
        batch=admission.batch,
        num_prompt_tokens=admission.num_prompt_tokens,
        bad_words_ids=[generate_pb2.TokenIds(ids=ids) for ids in admission.bad_words_ids],
        lora=admission.lora,
        prediction_ids=admission.prediction_ids,
    )


def plan_to_proto(step_id: int, plan: StepPlan) -> worker_pb2.StepPlan:
    draft, verify = plan.draft, plan.verify
    msg = worker_pb2.StepPlan(
        step_id=step_id,
        admit=[admission_to_proto(s) for s in plan.admit],
        release=plan.release,
        has_draft=draft is not None,
        has_verify=verify is not None,
        lora_changes=[lora_change_to_proto(c) for c in plan.lora],
    )
    if draft is not None:
        msg.draft.extend(
            worker_pb2.DraftTask(request_id=t.request_id, num_tokens=t.num_tokens, continue_window=t.continue_window,
                                 end=t.end)
            for t in draft.tasks
        )
        msg.tetris_capacity = draft.tetris_capacity or 0
        msg.draft_after_verify = draft.after_verify
    if verify is not None:
        msg.verify.extend(worker_pb2.VerifyTask(request_id=t.request_id, keep_bonus=t.keep_bonus) for t in verify.tasks)
    prefill = (draft.prefill if draft else []) or (verify.prefill if verify else [])  # the same chunks for both
    msg.prefill.extend(worker_pb2.PrefillTask(request_id=t.request_id, num_tokens=t.num_tokens) for t in prefill)
    return msg


def plan_from_proto(msg: worker_pb2.StepPlan) -> StepPlan:
    admit = [
        Admission(s.request_id, list(s.token_ids), sampling_from_proto(s.sampling), s.seed, s.batch,
                  s.num_prompt_tokens if s.HasField("num_prompt_tokens") else None,
                  [list(w.ids) for w in s.bad_words_ids], s.lora if s.HasField("lora") else None,
                  list(s.prediction_ids))
        for s in msg.admit
    ]
    prefill = [PrefillTask(t.request_id, t.num_tokens) for t in msg.prefill]
    draft = None
    if msg.has_draft:
        tasks = [DraftTask(t.request_id, t.num_tokens, t.continue_window, t.end) for t in msg.draft]
        draft = DraftPlan(tasks, tetris_capacity=msg.tetris_capacity or None, prefill=prefill,
                          after_verify=msg.draft_after_verify)
    verify = None
    if msg.has_verify:
        verify = VerifyPlan([VerifyTask(t.request_id, t.keep_bonus) for t in msg.verify], prefill=prefill)
    return StepPlan(admit, list(msg.release), lora_changes_from_proto(msg), draft, verify)


def lora_adapter_to_proto(module: LoraModule) -> worker_pb2.LoraAdapter:
    return worker_pb2.LoraAdapter(name=module.name, path=module.path, draft_path=module.draft_path or "")


def lora_adapter_from_proto(msg: worker_pb2.LoraAdapter) -> LoraModule:
    return LoraModule(name=msg.name, path=msg.path, draft_path=msg.draft_path or None)


def lora_change_to_proto(change: LoraChange) -> worker_pb2.LoraChange:
    if isinstance(change, str):
        return worker_pb2.LoraChange(unload=change)
    return worker_pb2.LoraChange(load=lora_adapter_to_proto(change))


def lora_changes_from_proto(msg: worker_pb2.StepPlan) -> list[LoraChange]:
    return [c.unload if c.WhichOneof("change") == "unload" else lora_adapter_from_proto(c.load)
            for c in msg.lora_changes]  # fmt: skip


def verified_to_proto(results: list[Verified]) -> list[worker_pb2.Verified]:
    return [
        worker_pb2.Verified(
            request_id=v.request_id,
            token_ids=v.token_ids,
            num_draft_tokens=v.num_draft_tokens,
            num_accepted=v.num_accepted,
            logprobs=logprobs_to_proto(v.logprobs),
            prompt_logprobs=logprobs_to_proto(v.prompt_logprobs),
        )
        for v in results
    ]


def verified_from_proto(msgs) -> list[Verified]:
    return [Verified(v.request_id, list(v.token_ids), v.num_draft_tokens, v.num_accepted,
                     logprobs_from_proto(v.logprobs), logprobs_from_proto(v.prompt_logprobs))
            for v in msgs]  # fmt: skip


def results_to_exchange(epoch: int, results: list[Verified]) -> worker_pb2.ExchangeMessage:
    """A step's results for a pool drafter: tokens and counts (it needs no logprobs)."""
    verified = [worker_pb2.Verified(request_id=v.request_id, token_ids=v.token_ids, num_draft_tokens=v.num_draft_tokens,
                                    num_accepted=v.num_accepted) for v in results]  # fmt: skip
    return worker_pb2.ExchangeMessage(epoch=epoch, request_ids=[v.request_id for v in results],
                                      results=worker_pb2.ExchangedResults(verified=verified))  # fmt: skip


def drafts_to_exchange(
    epoch: int, request_ids: list[str], windows: dict[str, Drafts], support_size: int
) -> worker_pb2.ExchangeMessage:
    """A step's windows for the verifier, in the plan's order; a request absent from `windows` had its window
    dropped (count -1). The q rows travel as raw little-endian arrays."""
    import torch

    unknown = windows.keys() - set(request_ids)
    if unknown:
        raise ValueError(f"windows for requests not in this transfer: {sorted(unknown)}")
    present = [windows[r] for r in request_ids if r in windows]
    drafts = worker_pb2.ExchangedDrafts(
        support_size=support_size, counts=[len(windows[r].tokens) if r in windows else -1 for r in request_ids],
        tokens=[t for window in present for t in window.tokens],
    )  # fmt: skip
    id_rows = [row for window in present for row in window.q_ids]
    if id_rows:
        q_ids = torch.stack(id_rows).to("cpu", torch.int64)
        q_probs = torch.stack([row for window in present for row in window.q_probs]).to("cpu", torch.float32)
        if q_ids.shape != (len(drafts.tokens), support_size) or q_probs.shape != q_ids.shape:
            raise ValueError(f"every draft token needs one q row of {support_size} ids and probabilities")
        drafts.q_ids, drafts.q_probs = q_ids.numpy().tobytes(), q_probs.numpy().tobytes()
    return worker_pb2.ExchangeMessage(epoch=epoch, request_ids=request_ids, drafts=drafts)


def drafts_from_exchange(msg: worker_pb2.ExchangeMessage, support_size: int, device) -> dict[str, Drafts]:
    """The windows by request (dropped ones absent), with q rows on `device`."""
    import torch

    drafts, total = msg.drafts, len(msg.drafts.tokens)
    if drafts.support_size != support_size:
        raise ValueError(f"drafts: the drafter sends q rows of {drafts.support_size} entries, this rank expects "
                         f"{support_size}")  # fmt: skip
    if len(drafts.counts) != len(msg.request_ids) or sum(c for c in drafts.counts if c > 0) != total:
        raise ValueError("drafts: the counts do not match the request ids and tokens")
    q_ids = torch.frombuffer(bytearray(drafts.q_ids), dtype=torch.int64) if total else torch.empty(0, dtype=torch.int64)
    q_probs = torch.frombuffer(bytearray(drafts.q_probs), dtype=torch.float32) if total else torch.empty(0)
    if q_ids.numel() != total * support_size or q_probs.numel() != total * support_size:
        raise ValueError("drafts: the q rows do not match the token count")
    id_rows = list(q_ids.view(total, support_size).to(device).unbind(0))
    prob_rows = list(q_probs.view(total, support_size).to(device).unbind(0))
    windows, offset = {}, 0
    for request_id, count in zip(msg.request_ids, drafts.counts):
        if count < 0:
            continue
        end = offset + count
        windows[request_id] = Drafts(tokens=list(drafts.tokens[offset:end]), q_ids=id_rows[offset:end],
                                     q_probs=prob_rows[offset:end])  # fmt: skip
        offset = end
    return windows


def step_reply(step_id: int, result: StepResult, role: str) -> worker_pb2.StepReply:
    """A worker's side of a step (engine/step.py) as its reply: a verifier that drafts too (colocate_drafter) reports
    its draft model's prefix cache apart, as a drafter does."""
    reply = worker_pb2.StepReply(
        step_id=step_id, draft_seconds=result.draft_seconds, verify_seconds=result.verify_seconds,
        draft_forwards=result.draft_forwards, draft_tokens=result.fed_to_draft, verify_tokens=result.fed_to_target,
        lora_loaded=result.lora_loaded, thread_trial=result.thread_trial, drafted=result.drafted,
        prefix_cache_queries=result.prefix_cache_queries.get(role, 0),
        prefix_cache_hits=result.prefix_cache_hits.get(role, 0),
        pool_queue=result.drafter_queue, pool_wait_seconds=result.drafter_wait_seconds,
    )  # fmt: skip
    reply.verified.extend(verified_to_proto(result.verified))
    if role == "verifier":
        reply.draft_prefix_cache_queries = result.prefix_cache_queries.get("drafter", 0)
        reply.draft_prefix_cache_hits = result.prefix_cache_hits.get("drafter", 0)
    return reply


def result_from_replies(replies: dict[str, worker_pb2.StepReply], plan: StepPlan) -> StepResult:
    """Merge the drafter's and the verifier's replies (by role) to the result of the step of `plan`."""
    result = StepResult()
    for role, reply in replies.items():
        result.worker_seconds[role] = reply.compute_seconds
        result.idle_seconds[role] = reply.idle_seconds
        result.verified.extend(verified_from_proto(reply.verified))
        result.drafted.update(reply.drafted)
        result.draft_seconds = max(result.draft_seconds, reply.draft_seconds)
        result.verify_seconds = max(result.verify_seconds, reply.verify_seconds)
        result.draft_forwards = max(result.draft_forwards, reply.draft_forwards)
        result.fed_to_draft = max(result.fed_to_draft, reply.draft_tokens)
        result.fed_to_target = max(result.fed_to_target, reply.verify_tokens)
        result.thread_trial = result.thread_trial or reply.thread_trial
        result.record_prefix_cache(role, (reply.prefix_cache_queries, reply.prefix_cache_hits))
        result.drafter_queue = max(result.drafter_queue, reply.pool_queue)
        result.drafter_wait_seconds = max(result.drafter_wait_seconds, reply.pool_wait_seconds)
        if reply.draft_prefix_cache_queries:  # a verifier that drafts too
            result.record_prefix_cache("drafter", (reply.draft_prefix_cache_queries, reply.draft_prefix_cache_hits))
        merge_loaded(result.lora_loaded, dict(reply.lora_loaded), f"the {role}: ")  # one's refusal is the group's
    result.draft_after_verify = plan.in_turn  # as the executor ordered the parts (engine/step.py, `ordered`)
    return result
