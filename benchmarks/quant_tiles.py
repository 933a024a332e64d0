"""Tiles for the FP8 and AWQ Triton GEMMs (model/kernels/triton_quant.py), swept on one CUDA GPU.

    python benchmarks/quant_tiles.py                 # Llama-3-8B's projections at 1, 16 and 64 rows
    python benchmarks/quant_tiles.py --rows 1 --quick
    python benchmarks/quant_tiles.py --grouped       # the grouped expert GEMMs (model/kernels/triton_moe.py) on
                                                     # Qwen3-235B-A22B's experts at 4-way TP, 1 to 256 tokens

For every projection shape and row count it times each tile choice, torch's bf16 GEMM on the dense weight
and the tiles `pick_tiles` chooses, and prints one table: the best tiles, their time, and the ratios to the
bf16 GEMM and to the floor (the quantized weight's bytes at the measured copy bandwidth). Use it to check
`pick_tiles` on a new GPU; it writes quant-tiles.json. With --grouped it does the same for the grouped
expert GEMMs (rows = tokens, each routed to 8 of 128 experts; the floor: the bytes of the experts the
tokens reach) against the tiles `grouped_tiles` chooses, and writes quant-tiles-grouped.json.
"""

from __future__ import annotations

import argparse
import functools
import itertools
import json
import sys
import time
from pathlib import Path

import torch

from minedraft.model.kernels.triton_moe import grouped_matmul, grouped_tiles, route, row_block
from minedraft.model.kernels.triton_quant import GemmTiles, awq_matmul, fp8_block_matmul, pick_tiles
from minedraft.model.quantization import dequantize_awq, dequantize_fp8

SHAPES = {"qkv": (6144, 4096), "o": (4096, 4096), "gate_up": (28672, 4096), "down": (4096, 14336)}  # (N, K)


def time_ms(fn, repeats: int = 20) -> float:
    """GPU time of one call: `repeats` calls captured in a CUDA graph and replayed, so that launching a
    kernel from Python (tens of microseconds for Triton) is not what is measured."""
    fn()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(repeats):
            fn()
    graph.replay()
    torch.cuda.synchronize()
    start = time.perf_counter()
    for _ in range(5):
        graph.replay()
    torch.cuda.synchronize()
    return (time.perf_counter() - start) / (5 * repeats) * 1e3


def copy_bandwidth() -> float:
    src = torch.empty(1 << 30, dtype=torch.uint8, device="cuda")
    dst = torch.empty_like(src)
    seconds = time_ms(lambda: dst.copy_(src), 5) / 1e3
    return 2 * src.numel() / seconds


def candidates(quick: bool) -> list[GemmTiles]:
    blocks_n = (64, 128) if quick else (32, 64, 128)
    splits = (1, 4, 8) if quick else (1, 2, 4, 8, 16)
    stages = (3,) if quick else (3, 4)
    return [GemmTiles(16, n, k, s, w, st)
            for n, k, s, w, st in itertools.product(blocks_n, (64, 128), splits, (4, 8), stages)]  # fmt: skip


def sweep(rows: list[int], quick: bool) -> list[dict]:
    bandwidth, results = copy_bandwidth(), []
    for (name, (n, k)), m in itertools.product(SHAPES.items(), rows):
        x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
        for kernel, (run, weight_bytes, dense) in quantized_weights(n, k).items():
            chosen = pick_tiles(m, n, k, 128, x.device, **({"block_n": 128, "block_k": 64} if kernel == "awq" else {}))
            timed = [(time_ms(functools.partial(run, x, t)), t) for t in candidates(quick)]
            best_ms, best = min(timed, key=lambda pair: pair[0])
            row = {"kernel": kernel, "shape": name, "rows": m,
                   "bf16_ms": round(time_ms(functools.partial(torch.nn.functional.linear, x, dense)), 4),
                   "best_ms": round(best_ms, 4), "best": best.__dict__,
                   "picked_ms": round(time_ms(functools.partial(run, x, chosen)), 4), "picked": chosen.__dict__,
                   "floor_ms": round(weight_bytes / bandwidth * 1e3, 4)}  # fmt: skip
            print(json.dumps(row), flush=True)
            results.append(row)
    return results


def quantized_weights(n: int, k: int) -> dict[str, tuple]:
    """Random FP8 (128 x 128 blocks) and AWQ (group 128) weights of shape [n, k]: each kernel's GEMM, its
    weight's bytes and the dense bf16 weight it stands for."""
    codes = (torch.randn(n, k, device="cuda") * 40).to(torch.float8_e4m3fn)
    scales = torch.rand(n // 128, k // 128, device="cuda") * 0.01
    packed = torch.randint(-(2**31), 2**31 - 1, (k, n // 8), dtype=torch.int32, device="cuda")
    zeros = torch.randint(-(2**31), 2**31 - 1, (k // 128, n // 8), dtype=torch.int32, device="cuda")
    awq_scales = (torch.rand(k // 128, n, device="cuda") * 0.01).to(torch.bfloat16)
    return {
        "fp8": (lambda x, t: fp8_block_matmul(x, codes, scales, (128, 128), t), n * k,
                dequantize_fp8(codes.cpu(), scales.cpu(), (128, 128)).to("cuda", torch.bfloat16)),
        "awq": (lambda x, t: awq_matmul(x, packed, zeros, awq_scales, 128, t), n * k // 2,
                dequantize_awq(packed.cpu(), zeros.cpu(), awq_scales.cpu(), 128, "w").to("cuda", torch.bfloat16)),
    }  # fmt: skip


# Qwen3-235B-A22B's experts on one of 4 tensor-parallel ranks: 128 experts, hidden 4096, 1536 / 4 = 384
# intermediate rows each, top 8. (N, K) of each grouped GEMM, and whether it reads one row per token.
EXPERTS, TOP_K = 128, 8
GROUPED_SHAPES = {"gate_up": (768, 4096, True), "down": (4096, 384, False)}


def grouped_candidates(quick: bool) -> list[GemmTiles]:
    blocks_n = (64, 128) if quick else (32, 64, 128)
    stages = (3,) if quick else (3, 4)
    return [GemmTiles(m, n, k, 1, w, st)
            for m, n, k, w, st in itertools.product((16, 32, 64), blocks_n, (64, 128), (4, 8), stages)]  # fmt: skip


def sweep_grouped(tokens: list[int], quick: bool) -> list[dict]:
    """Every tile choice of the grouped FP8 and AWQ GEMMs, random routing of `tokens` tokens."""
    from minedraft.model.quantization import QuantConfig, QuantizedWeight

    bandwidth, results, gen = copy_bandwidth(), [], torch.Generator(device="cuda").manual_seed(0)
    for (name, (n, k, per_token)), count in itertools.product(GROUPED_SHAPES.items(), tokens):
        routed = torch.rand(count, EXPERTS, device="cuda", generator=gen).topk(TOP_K, dim=-1).indices
        x = torch.randn(count if per_token else count * TOP_K, k, device="cuda", dtype=torch.bfloat16)
        reached = routed.unique().numel()
        for quant in (QuantConfig("fp8", block=(128, 128)), QuantConfig("awq", group_size=128)):
            with torch.device("cuda"):
                weight = QuantizedWeight(quant, n, k, torch.bfloat16, experts=EXPERTS)
            for part in weight.parts.values():  # random codes and packed words; scales of 1e-3 (not random bytes)
                if part.dtype in (torch.float8_e4m3fn, torch.int32):
                    part.view(torch.uint8).random_(generator=gen)
                else:
                    part.fill_(1e-3)
            routings = {m: route(routed, EXPERTS, m) for m in (16, 32, 64)}
            run = functools.partial(_grouped, x, weight, routings, per_token)
            timed = [(time_ms(functools.partial(run, t)), t) for t in grouped_candidates(quick)]
            best_ms, best = min(timed, key=lambda pair: pair[0])
            chosen = grouped_tiles(row_block(count * TOP_K, EXPERTS, False), quant.method, 128, x.device)
            row = {"kernel": quant.method, "shape": name, "rows": count, "experts_reached": reached,
                   "best_ms": round(best_ms, 4), "best": best.__dict__,
                   "picked_ms": round(time_ms(functools.partial(run, chosen)), 4), "picked": chosen.__dict__,
                   "floor_ms": round(weight.nbytes * reached / EXPERTS / bandwidth * 1e3, 4)}  # fmt: skip
            print(json.dumps(row), flush=True)
            results.append(row)
    return results


def _grouped(x: torch.Tensor, weight, routings: dict, per_token: bool, tiles: GemmTiles) -> torch.Tensor:
    return grouped_matmul(x, weight, routings[tiles.block_m], per_token, tiles)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], epilog=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)  # fmt: skip
    parser.add_argument("--rows", default=None, help="comma-separated row counts (tokens in the step); default "
                        "1,16,64, with --grouped 1,16,64,256")  # fmt: skip
    parser.add_argument("--quick", action="store_true", help="fewer tile choices")
    parser.add_argument("--grouped", action="store_true", help="the grouped expert GEMMs (--rows: tokens)")
    parser.add_argument("--out", type=Path, default=None, help="quant-tiles.json or quant-tiles-grouped.json")
    args = parser.parse_args(argv)
    if not torch.cuda.is_available():
        print("quant_tiles.py needs a CUDA GPU", file=sys.stderr)
        return 2
    rows = [int(r) for r in (args.rows or ("1,16,64,256" if args.grouped else "1,16,64")).split(",")]
    results = sweep_grouped(rows, args.quick) if args.grouped else sweep(rows, args.quick)
    out = args.out or Path("quant-tiles-grouped.json" if args.grouped else "quant-tiles.json")
    out.write_text(json.dumps(results, indent=2))
    if args.grouped:
        print("| kernel | shape | tokens | experts reached | picked ms | best ms | floor ms | best tiles |")
        print("|---|---|---|---|---|---|---|---|")
        for r in results:
            tiles = "{block_m}x{block_n}x{block_k} warps {num_warps} stages {num_stages}".format(**r["best"])
            print(f"| {r['kernel']} | {r['shape']} | {r['rows']} | {r['experts_reached']} | {r['picked_ms']} "
                  f"| {r['best_ms']} | {r['floor_ms']} | {tiles} |")
        return 0
    print("| kernel | shape | rows | bf16 ms | picked ms | best ms | floor ms | best tiles |")
    print("|---|---|---|---|---|---|---|---|")
    for r in results:
        tiles = "{block_n}x{block_k} split {split_k} warps {num_warps} stages {num_stages}".format(**r["best"])
        print(f"| {r['kernel']} | {r['shape']} | {r['rows']} | {r['bf16_ms']} | {r['picked_ms']} | {r['best_ms']} "
              f"| {r['floor_ms']} | {tiles} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
