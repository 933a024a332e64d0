"""LoRA adapters under speculative decoding, offline (`minedraft.LLM`) on the bundled pair.

    python benchmarks/lora.py drafter     # the shipped idlelib pair: the base drafter against the drafter adapter
    python benchmarks/lora.py speed       # 4 random r=16 adapters round-robin against the same engine without LoRA
    python benchmarks/lora.py all --rounds 5 --json lora.json

`drafter`: the target with the shipped target adapter (models/minedraft-target-lora-<domain>), drafted by the
base draft model or by the draft with its adapter (models/minedraft-draft-lora-<domain>), on held-out prompts
of the adapter's domain (models/prompts/lora-<domain>.jsonl) and on as many held-out prompts from other files
(models/prompts/heldout.jsonl). One engine serves both drafters (two lora_modules entries over the same target
adapter, one with draft_path), so the two differ only in the drafter. Their greedy outputs must be equal.

`speed`: r = 16 on all seven projections of every layer, 4 adapters with random weights (built here with
peft), the prompts spread over them round-robin, against the same engine without LoRA, in each mode.

Every setting runs once per round, the rounds interleaved (minedraft.bench.rounds), after a warm-up; each
setting's median round is reported. Read the ratios: the machine is shared and noisy.
"""

from __future__ import annotations

import argparse
import json
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import torch

from minedraft.bench.rounds import interleaved, median_by
from minedraft.engine.request import SpecDecodeStats
from minedraft.llm import LLM
from minedraft.sampling.params import SamplingParams

REPO = Path(__file__).resolve().parents[1]
MODELS = REPO / "models"
TARGET, DRAFT = MODELS / "minedraft-target", MODELS / "minedraft-draft"
PROMPTS = MODELS / "prompts" / "heldout.jsonl"
PROJECTIONS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
MODES: dict[str, dict | None] = {
    "ar": None,
    "sd": {},
    "minedraft": {"is_parallel": True},
}


@dataclass
class Run:
    seconds: float
    tokens: int
    accepted_length: float | None
    outputs: list[list[int]]

    @property
    def tokens_per_second(self) -> float:
        return self.tokens / self.seconds


def timed(llm: LLM, prompts: list[str], params: SamplingParams, lora: str | list[str | None] | None) -> Run:
    llm.engine.spec_stats = SpecDecodeStats()
    start = time.perf_counter()
    outputs = llm.generate(prompts, params, use_tqdm=False, lora_request=lora)
    seconds = time.perf_counter() - start
    ids = [list(o.outputs[0].token_ids) for o in outputs]
    stats = llm.engine.spec_stats
    return Run(seconds, sum(map(len, ids)), stats.mean_accepted_length if stats.num_drafts else None, ids)


def speculative(mode: str, k: int) -> dict | None:
    spec = MODES[mode]
    return None if spec is None else {"model": str(DRAFT), "num_speculative_tokens": k, "adaptive": False, **spec}


def report(round_: int, name: str, run: Run) -> None:
    acc = f", accepted length {run.accepted_length:.2f}" if run.accepted_length is not None else ""
    print(f"round {round_ + 1}: {name}: {run.tokens_per_second:.1f} tok/s{acc}", flush=True)


def medians(results: dict[str, list[Run]]) -> dict[str, Run]:
    return {name: median_by(runs, lambda r: r.tokens_per_second) for name, runs in results.items()}


# ----------------------------------------------------------------------------------------------- drafter


def domain_prompts(domain: str, count: int) -> tuple[list[str], list[str]]:
    """(held-out prompts of the domain, as many held-out prompts from other files)."""
    on = [json.loads(line)["prompt"] for line in (MODELS / "prompts" / f"lora-{domain}.jsonl").read_text().splitlines()]
    rows = [json.loads(line) for line in PROMPTS.read_text().splitlines()]
    off = [r["prompt"] for r in rows if not r["source"].startswith(domain + "/")]
    return on[:count], off[:count]


def bench_drafter(args: argparse.Namespace, params: SamplingParams) -> list[dict]:
    target_adapter = MODELS / f"minedraft-target-lora-{args.domain}"
    draft_adapter = MODELS / f"minedraft-draft-lora-{args.domain}"
    modules = [{"name": "base-drafter", "path": str(target_adapter)},
               {"name": "drafter-adapter", "path": str(target_adapter), "draft_path": str(draft_adapter)}]
    on, off = domain_prompts(args.domain, args.num_prompts)
    rows = []
    for mode in args.drafter_modes.split(","):
        llm = LLM(model=str(TARGET), speculative_config=speculative(mode, args.k), enable_lora=True,
                  lora_modules=modules, max_loras=2, max_num_seqs=args.num_prompts)
        try:
            settings = {f"{side}/{drafter}": (lambda _r, e=llm, p=prompts, d=drafter: timed(e, p, params, d))
                        for side, prompts in (("domain", on), ("off-domain", off))
                        for drafter in ("base-drafter", "drafter-adapter")}
            for drafter in ("base-drafter", "drafter-adapter"):  # warm-up
                timed(llm, on[:4], params, drafter)
            results = interleaved(settings, args.rounds, settle_s=args.settle_s, report=report)
        finally:
            llm.close()
        best = medians(results)
        for side in ("domain", "off-domain"):
            base, adapted = best[f"{side}/base-drafter"], best[f"{side}/drafter-adapter"]
            rows.append({
                "mode": mode, "prompts": side,
                "base_drafter": {"tok_s": round(base.tokens_per_second, 1), "accepted_length": base.accepted_length},
                "drafter_adapter": {"tok_s": round(adapted.tokens_per_second, 1),
                                    "accepted_length": adapted.accepted_length},
                "accepted_length_ratio": round(adapted.accepted_length / base.accepted_length, 3),
                "tok_s_ratio": round(adapted.tokens_per_second / base.tokens_per_second, 3),
                "outputs_differ": sum(a != b for a, b in zip(base.outputs, adapted.outputs, strict=True)),
            })
    print("\n| mode | prompts | base drafter: acc len | tok/s | drafter adapter: acc len | tok/s "
          "| acc len ratio | tok/s ratio | outputs differ |")
    print("|---|---|---|---|---|---|---|---|---|")
    for r in rows:
        b, a = r["base_drafter"], r["drafter_adapter"]
        print(f"| {r['mode']} | {r['prompts']} | {b['accepted_length']:.2f} | {b['tok_s']} | "
              f"{a['accepted_length']:.2f} | {a['tok_s']} | {r['accepted_length_ratio']:.2f} | "
              f"{r['tok_s_ratio']:.2f} | {r['outputs_differ']} |")
    return rows


# ------------------------------------------------------------------------------------------------- speed


def random_adapters(folder: Path, count: int, rank: int, std: float) -> list[Path]:
    """`count` PEFT adapters for the bundled target, r = `rank` on all seven projections of every layer, A and B
    drawn from N(0, std) (PEFT's default B = 0 would leave the output unchanged)."""
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    paths = []
    for index in range(count):
        torch.manual_seed(index)
        base = AutoModelForCausalLM.from_pretrained(TARGET, dtype=torch.float32)
        model = get_peft_model(base, LoraConfig(r=rank, lora_alpha=2 * rank, target_modules=PROJECTIONS,
                                                init_lora_weights=False))
        with torch.no_grad():
            for name, param in model.named_parameters():
                if "lora_" in name:
                    param.normal_(0.0, std)
        paths.append(folder / f"random-{index}")
        model.save_pretrained(paths[-1])
    return paths


def bench_speed(args: argparse.Namespace, params: SamplingParams) -> list[dict]:
    prompts = [json.loads(line)["prompt"] for line in PROMPTS.read_text().splitlines()][: args.num_prompts]
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        adapters = random_adapters(Path(tmp), args.adapters, args.rank, args.std)
        modules = [{"name": f"lora-{i}", "path": str(p)} for i, p in enumerate(adapters)]
        loras = [f"lora-{i % len(adapters)}" for i in range(len(prompts))]
        engines: dict[str, tuple[LLM, list[str | None] | None]] = {}
        try:
            for mode in args.speed_modes.split(","):
                spec = speculative(mode, args.k)
                engines[f"{mode}/no-lora"] = (LLM(model=str(TARGET), speculative_config=spec,
                                                  max_num_seqs=args.num_prompts), None)
                engines[f"{mode}/lora"] = (LLM(model=str(TARGET), speculative_config=spec, enable_lora=True,
                                               lora_modules=modules, max_loras=len(adapters),
                                               max_lora_rank=args.rank, max_num_seqs=args.num_prompts), loras)
            for llm, lora in engines.values():  # warm-up
                timed(llm, prompts[: len(adapters)], params, lora[: len(adapters)] if lora else None)
            settings = {name: (lambda _r, e=llm, lr=lora: timed(e, prompts, params, lr))
                        for name, (llm, lora) in engines.items()}
            best = medians(interleaved(settings, args.rounds, settle_s=args.settle_s, report=report))
        finally:
            for llm, _ in engines.values():
                llm.close()
    for mode in args.speed_modes.split(","):
        plain, lora = best[f"{mode}/no-lora"], best[f"{mode}/lora"]
        rows.append({"mode": mode, "no_lora_tok_s": round(plain.tokens_per_second, 1),
                     "lora_tok_s": round(lora.tokens_per_second, 1),
                     "ratio": round(lora.tokens_per_second / plain.tokens_per_second, 3),
                     "no_lora_accepted_length": plain.accepted_length, "lora_accepted_length": lora.accepted_length})
    print(f"\n| mode | no LoRA tok/s | {args.adapters} adapters r={args.rank} tok/s | ratio "
          "| acc len (no LoRA / LoRA) |")
    print("|---|---|---|---|---|")
    for r in rows:
        acc = ("-" if r["no_lora_accepted_length"] is None else
               f"{r['no_lora_accepted_length']:.2f} / {r['lora_accepted_length']:.2f}")
        print(f"| {r['mode']} | {r['no_lora_tok_s']} | {r['lora_tok_s']} | {r['ratio']:.2f} | {acc} |")
    return rows


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("what", choices=("drafter", "speed", "all"))
    p.add_argument("--domain", default="idlelib", help="the shipped LoRA pair's domain")
    p.add_argument("--num-prompts", type=int, default=32, help="prompts per run, all in flight")
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--k", type=int, default=4, help="draft tokens per step (fixed: adaptive off)")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--settle-s", type=float, default=1.0, help="idle seconds before each run")
    p.add_argument("--drafter-modes", default="sd,minedraft")
    p.add_argument("--speed-modes", default="ar,sd,minedraft")
    p.add_argument("--adapters", type=int, default=4)
    p.add_argument("--rank", type=int, default=16)
    p.add_argument("--std", type=float, default=0.02, help="std of the random adapters' A and B")
    p.add_argument("--json", type=Path, help="write the results here too")
    return p.parse_args()


def main() -> None:
    args = parse_args()
    params = SamplingParams(temperature=0, max_tokens=args.max_tokens, ignore_eos=True)
    results = {}
    if args.what in ("drafter", "all"):
        results["drafter"] = bench_drafter(args, params)
    if args.what in ("speed", "all"):
        results["speed"] = bench_speed(args, params)
    if args.json:
        args.json.write_text(json.dumps({"args": {k: str(v) for k, v in vars(args).items()}, **results}, indent=2))


if __name__ == "__main__":
    main()
