"""The GPU path in one command, on a machine with one CUDA GPU and PyTorch (no vLLM, no network).

    pip install torch==<the box's build> triton && pip install -e '.[test]'
    python benchmarks/gpu_suite.py                   # every step; writes gpu-suite.json and gpu-suite.md
    python benchmarks/gpu_suite.py --dry-run         # anywhere: the steps that run without a GPU (kernels
                                                     # under Triton's interpreter, small CPU runs); the
                                                     # CUDA-only steps are reported as skipped, with why

Steps:
  numerics   the bundled target on CUDA (bf16) against the CPU float32 reference: logit error, top-1 agreement
  triton     the paged attention kernel, compiled, against the reference attention (bf16 and fp32); the fused
             layer kernels (norm, rotary + KV write, SiLU-and-mul) against the torch ops they replace
  quant      the FP8 and AWQ Triton GEMMs against the dequantized weight, and their time against bf16 GEMMs
  moe        the grouped expert GEMMs (FP8, AWQ) on Qwen3-235B-A22B's experts at 4-way TP against the experts
             dequantized to bf16 and run one by one: error, and the time of each at 1 to 256 tokens
  graphs     CUDA graphs against eager steps: the same logits, and the step time of each (decode, verify)
  greedy     every decoding mode's greedy output on the bundled pair against ar on the same device
  bench      the offline benchmark (ar, sd, minedraft, sd+pard, sd+eagle3, minedraft+eagle3), and the services
             (drafter and verifier processes sharing the one GPU) through `minedraft bench --launch`
  shapes     the step shapes adaptive speculation chooses here (offline, 1 and 32 in flight) against each fixed one
  floor      one decode step of a Llama-3-8B-shaped model (random bf16 weights, config written here)
             against the HBM floor: (weight bytes + KV bytes) / measured copy bandwidth; with the fused
             layer kernels (the default) and without them, side by side
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import statistics
import sys
import tempfile
import time
import traceback
from collections.abc import Callable
from functools import partial
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
LLAMA3_8B = {
    "architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 4096, "intermediate_size": 14336,
    "num_hidden_layers": 32, "num_attention_heads": 32, "num_key_value_heads": 8, "vocab_size": 128256,
    "max_position_embeddings": 8192, "rms_norm_eps": 1e-5, "rope_theta": 500000.0, "tie_word_embeddings": False,
    "torch_dtype": "bfloat16",
}  # fmt: skip


class Skip(Exception):
    """A step that cannot run here (the reason is reported)."""


def _cuda(dry_run: bool):
    import torch

    if dry_run:
        raise Skip("dry run")
    if not torch.cuda.is_available():
        raise Skip("needs a CUDA GPU (torch.cuda.is_available() is False)")
    return torch.device("cuda")


def step_numerics(args: argparse.Namespace) -> dict:
    import torch

    from minedraft.config import BUNDLED_TARGET
    from minedraft.model.runner import ModelRunner, SeqInput

    device = _cuda(args.dry_run)
    prompts = [[(7 * i + 3 * j) % 4000 + 1 for j in range(n)] for i, n in enumerate((5, 37, 120))]
    logits = {}
    for name, dev, dtype in (("cpu", "cpu", torch.float32), ("cuda", str(device), torch.bfloat16)):
        runner = ModelRunner(BUNDLED_TARGET, max_seq_len=256, num_slots=len(prompts), device=dev, dtype=dtype)
        slots = [runner.allocate_slot() for _ in prompts]
        logits[name] = runner.forward([SeqInput(s, p, 0, num_logits=len(p)) for s, p in zip(slots, prompts)]).cpu()
    error = (logits["cuda"] - logits["cpu"]).abs().max().item()
    agree = (logits["cuda"].argmax(-1) == logits["cpu"].argmax(-1)).float().mean().item()
    passed = agree >= 0.98 and error < 0.5  # bf16 weights and activations against float32
    return {"passed": passed, "max_abs_logit_error": round(error, 4), "top1_agreement": round(agree, 4)}


def step_triton(args: argparse.Namespace) -> dict:
    import torch

    from minedraft.model.attention import attend, plan_attention
    from minedraft.model.kernels.triton_attention import _INTERPRETED, paged_attention, paged_meta
    from minedraft.model.kv_cache import NULL_BLOCK

    device = torch.device("cpu") if args.dry_run or not torch.cuda.is_available() else torch.device("cuda")
    if device.type == "cuda":  # Llama-3-8B's attention shape, decode to prefill
        heads, kv_heads, dim, block = 32, 8, 128, 16
        starts, lengths = [0, 1, 15, 16, 300, 1000, 64, 7], [200, 1, 1, 1, 5, 1, 8, 33]
    else:  # interpreted: the same cases, smaller
        heads, kv_heads, dim, block = 8, 2, 32, 16
        starts, lengths = [0, 1, 15, 16, 40, 7], [20, 1, 1, 1, 5, 9]
    gen = torch.Generator().manual_seed(0)
    order = torch.randperm(sum(-(-(s + n) // block) for s, n in zip(starts, lengths)) + 4, generator=gen) + 1
    tables, used = [], 0
    for s, n in zip(starts, lengths):
        need = -(-(s + n) // block)
        tables.append(order[used : used + need].tolist())
        used += need
    results = {}
    for dtype in (torch.bfloat16, torch.float32):
        cache = [torch.randn(kv_heads, int(order.max()) + 1, block, dim, generator=gen).to(device, dtype) for _ in "kv"]
        q = torch.randn(sum(lengths), heads, dim, generator=gen).to(device, dtype)
        plan = plan_attention(starts, lengths, tables, block, heads, kv_heads, device, batch_invariant=False)
        expected = attend(q.float(), cache[0].float(), cache[1].float(), plan, dim**-0.5)
        got = paged_attention(q, cache[0], cache[1], paged_meta(starts, lengths, tables, NULL_BLOCK, device),
                              dim**-0.5)  # fmt: skip
        results[str(dtype).removeprefix("torch.")] = round((got.float() - expected).abs().max().item(), 5)
    fused = _fused_kernel_errors(torch, device)
    passed = results["float32"] < 1e-3 and results["bfloat16"] < 5e-2 and max(fused.values()) < 2e-2
    return {"passed": passed, "device": device.type, "interpreted": _INTERPRETED, "max_abs_error": results,
            "fused_kernels_max_relative_error": fused}


def _fused_kernel_errors(torch, device) -> dict[str, float]:
    """The fused layer kernels (model/kernels/triton_fused.py) in bf16 against the torch ops they replace on the same
    device, at Llama-3-8B's shapes on a GPU (smaller, interpreted): the largest difference over the largest
    value (compiled, the kernels round as torch does; the norms' sums differ in order only)."""
    import torch.nn.functional as F

    from minedraft.model.config import RopeConfig
    from minedraft.model.kernels.triton_fused import add_rms_norm, rope_write_kv, silu_and_mul
    from minedraft.model.layers import RotaryEmbedding, rms_normalize

    cuda = device.type == "cuda"
    hidden, size, heads, kv_heads, dim = (4096, 14336, 32, 8, 128) if cuda else (64, 200, 4, 2, 32)
    tokens, block, dtype = 7, 16, torch.bfloat16
    gen = torch.Generator().manual_seed(1)
    randn = lambda *shape: torch.randn(*shape, generator=gen).to(device, dtype)  # noqa: E731
    error = lambda got, ref: ((got.float() - ref.float()).abs().max() / ref.float().abs().max()).item()  # noqa: E731
    x, residual, weight = randn(tokens, hidden), randn(tokens, hidden), randn(hidden)
    normed, stream = add_rms_norm(x, residual, weight, 1e-5)
    expected = x + residual
    errors = {"add_rms_norm": max(error(stream, expected), error(normed, weight * rms_normalize(expected, 1e-5)))}
    gate_up = randn(tokens, 2 * size) * 4
    errors["silu_and_mul"] = error(silu_and_mul(gate_up), F.silu(gate_up[:, :size]) * gate_up[:, size:])
    rope = RotaryEmbedding(dim, RopeConfig(theta=500000.0), 4096).to(device).table(
        torch.tensor([0, 5, 17, 100, 1023, 2000, 4095], device=device), dtype)
    qkv, norm = randn(tokens, (heads + 2 * kv_heads) * dim), (randn(dim), randn(dim), 1e-6)
    index = torch.tensor([3 * block + 1, 0, 7 * block + 15, block, 2 * block + 2, 5 * block, 9], device=device)
    caches = [torch.zeros(kv_heads, 10, block, dim, device=device, dtype=dtype) for _ in range(2)]
    q = rope_write_kv(qkv, rope, index, caches[0], caches[1], heads, kv_heads, norm)
    qk, v = qkv.view(tokens, -1, dim).split([heads + kv_heads, kv_heads], dim=1)
    qk = torch.cat((norm[0].expand(heads, -1), norm[1].expand(kv_heads, -1))) * rms_normalize(qk, 1e-6)
    q_ref, k_ref = RotaryEmbedding.rotate(qk, rope).split([heads, kv_heads], dim=1)
    stored = lambda cache: cache.view(kv_heads, -1, dim)[:, index].transpose(0, 1)  # noqa: E731
    errors["rope_write_kv"] = max(error(q, q_ref), error(stored(caches[0]), k_ref), error(stored(caches[1]), v))
    return {name: round(value, 5) for name, value in errors.items()}


def step_quant(args: argparse.Namespace) -> dict:
    """The FP8 and AWQ Triton GEMMs against the dequantized bf16 weight: error, and time against torch's bf16
    GEMM on the same dense weight (Llama-3-8B's MLP down projection, 14336 -> 4096, at 1, 16 and 64 rows)."""
    import torch

    from minedraft.model.kernels.triton_quant import _INTERPRETED, awq_matmul, fp8_block_matmul
    from minedraft.model.quantization import dequantize_awq, dequantize_fp8

    cuda = torch.cuda.is_available() and not args.dry_run
    device = torch.device("cuda" if cuda else "cpu")
    out, inp, rows = (4096, 14336, (1, 16, 64)) if cuda else (64, 256, (1, 5))  # interpreted: small
    gen = torch.Generator().manual_seed(0)
    codes = (torch.randn(out, inp, generator=gen) * 40).to(torch.float8_e4m3fn)
    scale = torch.rand(-(-out // 128), -(-inp // 128), generator=gen) * 0.01
    packed = torch.randint(-(2**31), 2**31 - 1, (inp, out // 8), generator=gen, dtype=torch.int32)
    zeros = torch.randint(-(2**31), 2**31 - 1, (inp // 128, out // 8), generator=gen, dtype=torch.int32)
    scales = (torch.rand(inp // 128, out, generator=gen) * 0.01).to(torch.bfloat16)
    fp8 = (codes.to(device), scale.to(device))
    awq = (packed.to(device), zeros.to(device), scales.to(device))
    dense = {"fp8": dequantize_fp8(codes, scale, (128, 128)).to(device, torch.bfloat16),
             "awq": dequantize_awq(packed, zeros, scales, 128, "w").to(device, torch.bfloat16)}  # fmt: skip
    kernels = {"fp8": lambda x: fp8_block_matmul(x, *fp8, (128, 128)), "awq": lambda x: awq_matmul(x, *awq, 128)}
    results, worst = {}, 0.0
    for m in rows:
        x = torch.randn(m, inp, generator=gen).to(device, torch.bfloat16)
        for name, kernel in kernels.items():
            reference = x.float() @ dense[name].float().T
            worst = max(worst, ((kernel(x).float() - reference).abs().max() / reference.abs().max()).item())
            if cuda:
                from quant_tiles import time_ms  # beside this script: GPU time from CUDA-graph replays

                results[f"{name} {m} rows"] = {"triton_ms": round(time_ms(partial(kernel, x)), 4),
                                               "bf16_ms": round(time_ms(partial(torch.nn.functional.linear, x,
                                                                                dense[name])), 4)}  # fmt: skip
    return {"passed": worst < 2e-2, "max_relative_error": round(worst, 5), "interpreted": _INTERPRETED,
            "timings": results}  # fmt: skip


def step_moe(args: argparse.Namespace) -> dict:
    """The grouped expert GEMMs (model/kernels/triton_moe.py) on Qwen3-235B-A22B's experts at 4-way tensor
    parallelism (128 experts, hidden 4096, 384 intermediate rows per rank, top 8; random FP8 and AWQ stacks):
    a MoE step (gate/up, SiLU x up, down, weighted combine) against the same experts dequantized to bf16 and
    run expert by expert as the model's unquantized path does (error), and the time of each at 1 to 256
    tokens: the grouped launches (FP8, AWQ, and bf16 through the same kernel) as CUDA-graph replays, and the
    expert-by-expert loop, which syncs with the host, by wall clock."""
    import torch

    from minedraft.model.kernels.triton_moe import _INTERPRETED, fused_experts
    from minedraft.model.quantization import QuantConfig

    cuda = torch.cuda.is_available() and not args.dry_run
    device = torch.device("cuda" if cuda else "cpu")
    experts, hidden, local, top_k, counts = (128, 4096, 384, 8, (1, 16, 64, 256)) if cuda else (6, 64, 32, 2, (1, 5))
    gen = torch.Generator().manual_seed(0)
    stacks = {"fp8": _random_expert_stacks(QuantConfig("fp8", block=(128, 128) if cuda else (16, 16)), experts,
                                           hidden, local, device, gen),
              "awq": _random_expert_stacks(QuantConfig("awq", group_size=128 if cuda else 16), experts, hidden, local,
                                           device, gen)}  # fmt: skip
    results, worst, loop_worst = {}, 0.0, 0.0
    for tokens in counts:
        x = torch.randn(tokens, hidden, generator=gen).to(device, torch.bfloat16)
        weights, routed = torch.softmax(torch.randn(tokens, experts, generator=gen), -1).topk(top_k, dim=-1)
        weights, routed = (weights / weights.sum(-1, keepdim=True)).to(device, torch.bfloat16), routed.to(device)
        timings = {}
        for name, (w13, w2) in stacks.items():
            dense = (w13.dequantize(), w2.dequantize())
            grouped = partial(fused_experts, x, routed, weights, w13, w2, experts, False)
            reference = _experts_one_by_one(torch, x.float(), routed, weights.float(), *(w.float() for w in dense))
            worst = max(worst, _relative_error(grouped(), reference))
            loop_worst = max(loop_worst, _relative_error(_experts_one_by_one(torch, x, routed, weights, *dense),
                                                         reference))  # fmt: skip
            if cuda:
                from quant_tiles import time_ms  # beside this script: GPU time from CUDA-graph replays

                timings[f"{name}_grouped_ms"] = round(time_ms(grouped), 4)
                if name == "fp8":
                    timings["bf16_grouped_ms"] = round(time_ms(partial(fused_experts, x, routed, weights, *dense,
                                                                       experts, False)), 4)  # fmt: skip
                    timings["fp8_grouped_eager_ms"] = round(_wall_ms(torch, grouped), 4)
                    timings["bf16_one_by_one_eager_ms"] = round(_wall_ms(torch, partial(
                        _experts_one_by_one, torch, x, routed, weights, *dense)), 4)  # fmt: skip
            del dense
        results[f"{tokens} tokens"] = timings
    # Errors against float32 products of the same bf16 weights. The interpreter (Triton 3.9) rounds float32
    # to bf16 by truncation, not to nearest, so interpreted the grouped path's error is about twice a GPU's.
    return {"passed": worst < (4e-2 if _INTERPRETED else 2e-2), "max_relative_error": round(worst, 5),
            "bf16_one_by_one_max_relative_error": round(loop_worst, 5), "interpreted": _INTERPRETED,
            "timings": results}  # fmt: skip


def _random_expert_stacks(quant, experts: int, hidden: int, local: int, device, gen) -> tuple:
    """Random stacked gate/up [experts, 2 x local, hidden] and down [experts, hidden, local] weights as the
    checkpoint would store them (model/quantization.py's QuantizedWeight), scaled like real weights."""
    import torch

    from minedraft.model.quantization import QuantizedWeight

    stacks = []
    for out, inp in ((2 * local, hidden), (hidden, local)):
        with torch.device(device):
            stack = QuantizedWeight(quant, out, inp, torch.bfloat16, experts=experts)
        for name, part in stack.parts.items():
            if part.dtype == torch.float8_e4m3fn:
                part.copy_((torch.randn(part.shape, generator=gen) * 40).to(torch.float8_e4m3fn))
            elif part.dtype == torch.int32:
                part.copy_(torch.randint(-(2**31), 2**31 - 1, part.shape, generator=gen, dtype=torch.int32))
            else:  # fp8 block scales, awq group scales: weights of about 0.02
                part.copy_(torch.rand(part.shape, generator=gen) * (1e-3 if name == "scale" else 5e-3))
        stacks.append(stack)
    return tuple(stacks)


def _experts_one_by_one(torch, x, routed, weights, w13, w2):
    """The model's unquantized MoE path (StackedExperts on CPU): expert by expert, dense weights."""
    out = torch.zeros_like(x)
    for expert in routed.unique().tolist():
        tokens, slots = (routed == expert).nonzero(as_tuple=True)
        gate, up = torch.nn.functional.linear(x[tokens], w13[expert]).chunk(2, dim=-1)
        y = torch.nn.functional.linear(torch.nn.functional.silu(gate) * up, w2[expert])
        out.index_add_(0, tokens, y * weights[tokens, slots, None])
    return out


def _relative_error(got, reference) -> float:
    return ((got.float() - reference).abs().max() / reference.abs().max()).item()


def _wall_ms(torch, fn, repeats: int = 20) -> float:
    fn()
    torch.cuda.synchronize()
    start = time.perf_counter()
    for _ in range(repeats):
        fn()
    torch.cuda.synchronize()
    return (time.perf_counter() - start) / repeats * 1e3


def step_graphs(args: argparse.Namespace) -> dict:
    """CUDA graphs against eager steps on the bundled target (bf16): decode steps at batch 1, 8 and 32 and a
    k + 1 = 5 verification step, the same logits (and the states an EAGLE-3 head reads) expected and the step
    time of each."""
    import torch

    from minedraft.config import BUNDLED_TARGET
    from minedraft.model.runner import ModelRunner, SeqInput

    device = _cuda(args.dry_run)
    runners = {name: ModelRunner(BUNDLED_TARGET, max_seq_len=512, num_slots=32, device=str(device),
                                 dtype=torch.bfloat16, enforce_eager=name == "eager", aux_hidden_layers=(1, 3, 5))
               for name in ("graphs", "eager")}  # fmt: skip
    if runners["graphs"].graphs is None:
        return {"passed": False, "error": "no CUDA graphs were captured (is triton installed?)"}
    prompts = [[(11 * i + 5 * j) % 4000 + 1 for j in range(100 + 3 * i)] for i in range(32)]
    results, worst = {}, 0.0
    for runner in runners.values():
        slots = [runner.allocate_slot() for _ in prompts]
        runner.forward([SeqInput(s, p, 0) for s, p in zip(slots, prompts)])
    for batch, width in ((1, 1), (8, 1), (32, 1), (8, 5)):
        step = [SeqInput(i, [7 + j for j in range(width)], len(prompts[i]), num_logits=width) for i in range(batch)]
        logits, ms, aux = {}, {}, {}
        for name, runner in runners.items():
            logits[name] = runner.forward(step).float()
            aux[name] = runner.aux_hidden.float()
            torch.cuda.synchronize()
            start = time.perf_counter()
            for _ in range(50):
                runner.forward(step)  # the same positions again: a repeatable step
            torch.cuda.synchronize()
            ms[name] = (time.perf_counter() - start) / 50 * 1e3
        worst = max(worst, (logits["graphs"] - logits["eager"]).abs().max().item(),
                    (aux["graphs"] - aux["eager"]).abs().max().item())
        results[f"batch {batch} x {width}"] = {"graph_ms": round(ms["graphs"], 3), "eager_ms": round(ms["eager"], 3)}
    return {"passed": worst < 0.5, "max_abs_logit_difference": round(worst, 4), "steps": results}


def step_greedy(args: argparse.Namespace) -> dict:
    from minedraft import LLM, SamplingParams
    from minedraft.bench.offline import mode_configs
    from minedraft.bench.prompts import load_prompts
    from minedraft.config import EngineConfig

    device = _device(args)
    prompts = load_prompts(limit=4 if args.dry_run else 16)
    params = SamplingParams(temperature=0, max_tokens=8 if args.dry_run else 48, ignore_eos=True)
    outputs, differing, missing = {}, {}, []
    for mode, spec in mode_configs({"num_speculative_tokens": 4}).items():
        if spec is not None and not EngineConfig(speculative_config=spec).draft_path.exists():
            missing.append(mode)  # a bundled draft or head this checkout does not have
            continue
        llm = LLM(speculative_config=spec, device=device, max_num_seqs=8)
        try:
            outputs[mode] = [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]
        finally:
            llm.close()
        differing[mode] = sum(a != b for a, b in zip(outputs[mode], outputs["ar"]))
    # The fast kernels may differ from ar on a near-tie of the target's top-2 logits; count, do not hide.
    return {"passed": all(n == 0 for n in differing.values()), "device": device, "outputs_differing_from_ar": differing,
            **({"skipped_no_checkpoint": missing} if missing else {})}


def step_bench(args: argparse.Namespace) -> dict:
    from minedraft import SamplingParams
    from minedraft.bench.launch import run_launch_bench
    from minedraft.bench.offline import run_offline_bench
    from minedraft.bench.prompts import load_prompts

    device = _device(args)
    prompts = load_prompts(limit=4 if args.dry_run else 64)
    max_tokens = 8 if args.dry_run else 128
    params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
    engine = {"device": device, "max_num_seqs": 32}
    modes = ["ar", "sd", "minedraft", "sd+pard", "sd+eagle3", "minedraft+eagle3"]
    offline = run_offline_bench(prompts, modes, {"num_speculative_tokens": 4}, params,
                                repeats=1 if args.dry_run else 3, **engine)  # fmt: skip
    report = {"device": device, "offline_tok_s": {r.name: round(r.tokens_per_second, 1) for r in offline},
              "offline_mean_accepted_length": {r.name: round(r.spec_stats.mean_accepted_length, 2)
                                               for r in offline if r.spec_stats.num_drafts}}  # fmt: skip
    if args.dry_run:
        report["served"] = "skipped: dry run"
    else:
        served = run_launch_bench(["ar", "sd", "minedraft", "minedraft+eagle3"], {"num_speculative_tokens": 4}, engine,
                                  prompts,
                                  log_dir=Path(tempfile.mkdtemp(prefix="gpu-suite-")), max_tokens=max_tokens,
                                  concurrency=32, temperature=0.0, ignore_eos=True, repeats=3)  # fmt: skip
        report["served_tok_s"] = {mode: round(r.output_throughput, 1) for mode, r in served.items()}
    return {"passed": True, **report}


def step_shapes(args: argparse.Namespace) -> dict:
    """The step shapes adaptive speculation chooses on this device (offline, bundled pair), against each fixed
    shape, at 1 and 32 requests in flight: tok/s (median of 3 rounds) and the steps run by shape."""
    from minedraft.bench.prompts import load_prompts
    from minedraft.config import EngineConfig
    from minedraft.engine.engine import LLMEngine
    from minedraft.sampling.params import SamplingParams

    device = _device(args)
    k4 = {"num_speculative_tokens": 4}
    engines = {"ar": None, "sd-fixed": {**k4, "adaptive": False}, "sd-k2-fixed": {"num_speculative_tokens": 2,
               "adaptive": False}, "minedraft-fixed": {**k4, "is_parallel": True, "adaptive": False},
               "sd": k4, "minedraft": {**k4, "is_parallel": True}}  # fmt: skip
    prompts = load_prompts(limit=160)
    max_tokens = 8 if args.dry_run else 64
    params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
    report: dict[str, dict] = {}
    for load in (1, 32):
        for name, spec in engines.items():
            two = spec is not None and spec.get("is_parallel")
            config = EngineConfig(device=device, max_num_seqs=max(1, load // 2) if two else load,
                                  speculative_config=spec, enable_prefix_caching=False)  # fmt: skip
            engine = LLMEngine.local(config, max_in_flight=2)
            # A round of 8 requests one at a time at 1 in flight, 64 at 32: a round of a single request took
            # 40 ms on an H200, and its rate moved 2x from one run to the next.
            size = 1 if args.dry_run else max(8, 2 * load)
            _engine_round(engine, prompts[:size], params, load)  # warm-up (CUDA graphs, the controller's fits)
            rounds = [[prompts[(size * (i + 1) + j) % len(prompts)] for j in range(size)]
                      for i in range(1 if args.dry_run else 3)]  # fmt: skip
            rates = [_engine_round(engine, batch, params, load) for batch in rounds]
            steps = {s.value: n for s, n in engine.pipeline.steps_by_shape.items()}
            report[f"{name}@{load}"] = {"tok_s": round(statistics.median(rates), 1), "steps_by_shape": steps}
            engine.executor.close()
            del engine
    return {"passed": True, **report}


def _engine_round(engine, prompts: list[str], params, in_flight: int | None = None) -> float:
    """Output tokens per second of one round over `prompts`: all submitted at once, or `in_flight` at a time (a
    two-batch engine admits twice its max_num_seqs)."""
    start, requests, queue = time.perf_counter(), [], list(prompts)
    while queue or engine.has_unfinished():
        while queue and (in_flight is None or len(engine.requests) < in_flight):
            requests.append(engine.add_request(engine.tokenizer.encode(queue.pop(0)), params))
        engine.advance()
    return sum(len(r.output_ids) for r in requests) / (time.perf_counter() - start)


def step_floor(args: argparse.Namespace) -> dict:
    """The decode step with the fused layer kernels (the default) and without them (fused_kernels="off"),
    one model at a time on the same GPU, against the HBM floor."""
    import torch

    device = _cuda(args.dry_run)
    context = 1024
    runs = {fused: _floor_decode_step(torch, device, context, fused) for fused in ("auto", "off")}
    weights = runs["auto"]["weight_bytes"]
    kv = 2 * LLAMA3_8B["num_hidden_layers"] * LLAMA3_8B["num_key_value_heads"] * 128 * context * 2
    bandwidth = _copy_bandwidth(torch, device)
    floor = (weights + kv) / bandwidth
    fused, unfused = runs["auto"]["step_s"], runs["off"]["step_s"]
    return {"passed": True, "decode_step_ms": round(fused * 1e3, 3), "unfused_decode_step_ms": round(unfused * 1e3, 3),
            "hbm_floor_ms": round(floor * 1e3, 3), "step_over_floor": round(fused / floor, 2),
            "unfused_step_over_floor": round(unfused / floor, 2), "copy_bandwidth_gb_s": round(bandwidth / 1e9, 1),
            "weight_bytes": weights, "kv_bytes": kv, "attention_kernel": runs["auto"]["attention_kernel"],
            "fused_kernels": runs["auto"]["fused_kernels"], "cuda_graphs": runs["auto"]["cuda_graphs"],
            "top_kernels_ms_per_step": runs["auto"]["kernels"],
            "unfused_top_kernels_ms_per_step": runs["off"]["kernels"]}  # fmt: skip


def _floor_decode_step(torch, device, context: int, fused_kernels: str) -> dict:
    """One runner of the Llama-3-8B shape (random weights): its median decode step after `context` tokens,
    and its top kernels. The runner is dropped before returning, so the next one has the memory."""
    import gc

    from minedraft.model.runner import ModelRunner, SeqInput

    with tempfile.TemporaryDirectory() as folder:
        (Path(folder) / "config.json").write_text(json.dumps(LLAMA3_8B))
        shutil.copy(REPO / "models" / "minedraft-target" / "tokenizer.json", folder)  # never used to encode
        runner = ModelRunner(folder, max_seq_len=context + 8, device=str(device), dtype=torch.bfloat16,
                             load_format="dummy", kv_cache_memory_bytes=4 << 30,
                             fused_kernels=fused_kernels)  # fmt: skip
    slot = runner.allocate_slot()
    runner.forward([SeqInput(slot, [1] * context, 0, num_logits=1)])
    decode = partial(runner.forward, [SeqInput(slot, [2], context, num_logits=1)])
    times = []
    for _ in range(30):
        torch.cuda.synchronize()
        start = time.perf_counter()
        decode()
        torch.cuda.synchronize()
        times.append(time.perf_counter() - start)
    result = {"step_s": statistics.median(times[5:]), "kernels": _top_kernels(torch, decode),
              "weight_bytes": sum(p.numel() * p.element_size() for p in runner.model.parameters()),
              "attention_kernel": "triton" if runner.paged_kernel else "torch", "fused_kernels": runner.fused_kernels,
              "cuda_graphs": runner.graphs is not None}  # fmt: skip
    del runner, decode
    gc.collect()
    torch.cuda.empty_cache()
    return result


def _top_kernels(torch, step: Callable[[], object], steps: int = 5, top: int = 20) -> dict[str, float]:
    """GPU time per step of the kernels that take most of it, each named with its launches per step, and of all
    kernels together (torch's profiler over a few steps)."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(steps):
            step()
        torch.cuda.synchronize()
    events = [e for e in prof.key_averages() if e.device_type.name == "CUDA"]
    events.sort(key=lambda e: e.self_device_time_total, reverse=True)
    table = {f"{e.key[:72]} x{e.count // steps}": round(e.self_device_time_total / steps / 1e3, 3)
             for e in events[:top]}
    launches = sum(e.count for e in events) // steps
    table[f"all kernels x{launches}"] = round(sum(e.self_device_time_total for e in events) / steps / 1e3, 3)
    return table


def _copy_bandwidth(torch, device) -> float:
    """Bytes per second one device-to-device copy moves (read + write)."""
    src = torch.empty(1 << 30, dtype=torch.uint8, device=device)
    dst = torch.empty_like(src)
    for _ in range(3):
        dst.copy_(src)
    torch.cuda.synchronize()
    start = time.perf_counter()
    for _ in range(10):
        dst.copy_(src)
    torch.cuda.synchronize()
    return 2 * src.numel() * 10 / (time.perf_counter() - start)


def _device(args: argparse.Namespace) -> str:
    import torch

    return "cuda" if torch.cuda.is_available() and not args.dry_run else "cpu"


STEPS: dict[str, Callable[[argparse.Namespace], dict]] = {
    "numerics": step_numerics, "triton": step_triton, "quant": step_quant, "moe": step_moe, "graphs": step_graphs,
    "greedy": step_greedy,
    "bench": step_bench,
    "shapes": step_shapes,
    "floor": step_floor,
}  # fmt: skip


def run(args: argparse.Namespace) -> dict:
    import torch

    report = {"machine": {"python": platform.python_version(), "torch": torch.__version__,
                          "gpu": torch.cuda.get_device_name(0) if torch.cuda.is_available() else None,
                          "dry_run": args.dry_run}, "steps": {}}  # fmt: skip
    for name in args.steps.split(","):
        print(f"== {name}", flush=True)
        start = time.perf_counter()
        try:
            result = {"status": "passed", **STEPS[name](args)}
            if not result.pop("passed"):
                result["status"] = "failed"
        except Skip as reason:
            result = {"status": "skipped", "reason": str(reason)}
        except Exception as exc:  # one broken step must not hide the others' numbers
            result = {"status": "failed", "error": f"{type(exc).__name__}: {exc}", "trace": traceback.format_exc()}
        result["seconds"] = round(time.perf_counter() - start, 1)
        report["steps"][name] = result
        print(json.dumps({k: v for k, v in result.items() if k != "trace"}), flush=True)
    return report


def markdown(report: dict) -> str:
    rows = ["| step | status | numbers |", "|---|---|---|"]
    for name, result in report["steps"].items():
        numbers = {k: v for k, v in result.items() if k not in ("status", "trace")}
        rows.append(f"| {name} | {result['status']} | `{json.dumps(numbers)}` |")
    return f"GPU: {report['machine']['gpu'] or 'none'}, torch {report['machine']['torch']}\n\n" + "\n".join(rows) + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter, epilog=__doc__)
    parser.add_argument("--dry-run", action="store_true",
                        help="without a GPU: kernels under Triton's interpreter, small CPU runs, CUDA steps skipped")
    parser.add_argument("--steps", default=",".join(STEPS), help=f"comma-separated, of {','.join(STEPS)}")
    parser.add_argument("--out", type=Path, default=Path("gpu-suite"), help="writes OUT.json and OUT.md")
    args = parser.parse_args(argv)
    unknown = [s for s in args.steps.split(",") if s not in STEPS]
    if unknown:
        parser.error(f"unknown step(s) {unknown}; choose from {list(STEPS)}")
    if args.dry_run:
        os.environ.setdefault("TRITON_INTERPRET", "1")  # before anything imports triton
    report = run(args)
    args.out.with_suffix(".json").write_text(json.dumps(report, indent=2))
    args.out.with_suffix(".md").write_text(markdown(report))
    print(markdown(report))
    return 1 if any(r["status"] == "failed" for r in report["steps"].values()) else 0


if __name__ == "__main__":
    sys.exit(main())
