"""One offline engine in a process of its own, driven over stdin / stdout one JSON line at a time
(`minedraft.bench.engines` starts it): ours (`minedraft.LLM`) or vLLM's (`vllm.LLM`).

    python engine_worker.py JOB        # JOB: the engine's settings, JSON; then `ready`, `run`, ..., `quit`

`ready` runs the warm-up, `run` times one `generate` over all prompts and answers its outputs and acceptance.
Run by path, also by the vLLM venv's python, where minedraft is not installed: nothing of the package is
imported at module level, and `import minedraft` (which sets an OpenMP spin) happens only in our engines.
"""

from __future__ import annotations

import json
import os
import sys
import time
from collections.abc import Callable
from pathlib import Path

Outputs = tuple[list[list[int]], float, float | None, list[float]]  # tokens, acc length, mean k, per position


def serve(job: dict) -> int:
    protocol = os.fdopen(os.dup(1), "w")  # answers go here; everything the engine prints goes to the log
    os.dup2(2, 1)
    lines = Path(job["prompts"]).read_text().splitlines()[: job["num_prompts"]]
    prompts = [json.loads(line)["prompt"] for line in lines]
    generate = _vllm_engine(job) if job["kind"] == "vllm" else _our_engine(job)
    for command in sys.stdin:
        command = command.strip()
        if command == "quit":
            break
        if command == "ready":
            for _ in range(job["warmup"]):
                generate(prompts)
            answer = {}
        else:
            start = time.perf_counter()
            tokens, accepted_length, mean_k, per_pos = generate(prompts)
            seconds = time.perf_counter() - start
            answer = {"seconds": seconds, "output_tokens": sum(map(len, tokens)), "tokens": tokens,
                      "mean_accepted_length": accepted_length, "mean_k": mean_k,
                      "acceptance_per_position": per_pos}  # fmt: skip
        protocol.write(json.dumps(answer) + "\n")
        protocol.flush()
    return 0


def _random_draft(draft: Path) -> str:
    """A copy of `draft` with random weights (normal, std 0.02): its drafts are almost never accepted."""
    import shutil
    import tempfile

    import torch
    from safetensors.torch import load_file, save_file

    folder = Path(tempfile.mkdtemp(prefix="random-draft-"))
    for item in draft.iterdir():
        if item.suffix != ".safetensors":
            shutil.copy(item, folder / item.name)
    generator = torch.Generator().manual_seed(0)
    weights = {name: torch.randn(t.shape, generator=generator, dtype=torch.float32).to(t.dtype) * 0.02
               for name, t in load_file(draft / "model.safetensors").items()}  # fmt: skip
    save_file(weights, folder / "model.safetensors", metadata={"format": "pt"})
    return str(folder)


def _our_engine(job: dict) -> Callable[[list[str]], Outputs]:
    from minedraft import LLM, SamplingParams
    from minedraft.engine.request import SpecDecodeStats

    spec = job["spec"]
    if spec is not None and spec.get("model") == "random":
        spec = {**spec, "model": _random_draft(Path(job["draft"]))}
    batches = 2 if spec is not None and spec.get("is_parallel") and not spec.get("force_pearl") else 1
    # One in flight in MineDraft modes: two batches of one would hold two, so the prompts go one at a time.
    one_at_a_time = job["max_num_seqs"] < batches
    llm = LLM(speculative_config=spec, max_num_seqs=max(1, job["max_num_seqs"] // batches), dtype="float32",
              device=job["device"], batch_invariant=job["batch_invariant"],
              enable_prefix_caching=job.get("prefix_caching", False))  # fmt: skip
    params = SamplingParams(temperature=0, max_tokens=job["max_tokens"], ignore_eos=True)

    def generate(prompts: list[str]) -> Outputs:
        """Outputs, mean accepted length, the mean k adaptive speculation chose (None: fixed k or ar), and the
        share of verifications whose draft token j was accepted, per j."""
        llm.engine.spec_stats = SpecDecodeStats()
        controller = llm.engine.pipeline.controller
        before = dict(controller.windows) if controller else {}
        if one_at_a_time:
            outputs = [output for prompt in prompts for output in llm.generate([prompt], params, use_tqdm=False)]
        else:
            outputs = llm.generate(prompts, params, use_tqdm=False)
        mean_k = None
        if controller is not None:
            chosen = {k: n - before.get(k, 0) for k, n in controller.windows.items()}
            mean_k = sum(k * n for k, n in chosen.items()) / max(1, sum(chosen.values()))
        stats = llm.engine.spec_stats
        per_pos = [n / stats.num_drafts for n in stats.num_accepted_tokens_per_pos] if stats.num_drafts else []
        return [o.outputs[0].token_ids for o in outputs], stats.mean_accepted_length, mean_k, per_pos

    return generate


def _vllm_engine(job: dict) -> Callable[[list[str]], Outputs]:
    from vllm import LLM, SamplingParams

    # Prefix caching off by default: every round sends the same prompts, and with it vLLM would skip their
    # prefill from the second round on (the warm-up's), measuring cache hits instead of serving them.
    llm = LLM(model=job["target"], speculative_config=job["spec"], max_num_seqs=job["max_num_seqs"],
              dtype="float32", max_model_len=1024, seed=0, disable_log_stats=False,
              enable_prefix_caching=job.get("prefix_caching", False))  # fmt: skip
    params = SamplingParams(temperature=0, max_tokens=job["max_tokens"], ignore_eos=True)

    def counters() -> tuple[float, float, list[float]]:
        metrics = {m.name: m for m in llm.get_metrics()}
        value = lambda name: getattr(metrics.get(name), "value", 0)  # noqa: E731
        per_pos = list(getattr(metrics.get("vllm:spec_decode_num_accepted_tokens_per_pos"), "values", []))
        return value("vllm:spec_decode_num_drafts"), value("vllm:spec_decode_num_accepted_tokens"), per_pos

    def generate(prompts: list[str]) -> Outputs:
        drafts, accepted, per_pos = counters()
        outputs = llm.generate(prompts, params, use_tqdm=False)
        drafts_after, accepted_after, per_pos_after = counters()
        num_drafts = drafts_after - drafts
        length = 1 + (accepted_after - accepted) / num_drafts if num_drafts else 0.0
        per_pos = per_pos or [0.0] * len(per_pos_after)
        rates = [(b - a) / num_drafts for a, b in zip(per_pos, per_pos_after)] if num_drafts else []
        return [list(o.outputs[0].token_ids) for o in outputs], length, None, rates

    return generate


if __name__ == "__main__":
    sys.exit(serve(json.loads(sys.argv[1])))
