"""Tiles for the FP8 and AWQ Triton GEMMs (model/triton_quant.py), swept on one CUDA GPU.

    python benchmarks/quant_tiles.py                 # Llama-3-8B's projections at 1, 16 and 64 rows
    python benchmarks/quant_tiles.py --rows 1 --quick

For every projection shape and row count it times each tile choice, torch's bf16 GEMM on the dense weight
and the tiles `pick_tiles` chooses, and prints one table: the best tiles, their time, and the ratios to the
bf16 GEMM and to the floor (the quantized weight's bytes at the measured copy bandwidth). Use it to check
`pick_tiles` on a new GPU; it writes quant-tiles.json.
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

from minedraft.model.quantization import dequantize_awq, dequantize_fp8
from minedraft.model.triton_quant import GemmTiles, awq_matmul, fp8_block_matmul, pick_tiles

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


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], epilog=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)  # fmt: skip
    parser.add_argument("--rows", default="1,16,64", help="comma-separated row counts (tokens in the step)")
    parser.add_argument("--quick", action="store_true", help="fewer tile choices")
    parser.add_argument("--out", type=Path, default=Path("quant-tiles.json"))
    args = parser.parse_args(argv)
    if not torch.cuda.is_available():
        print("quant_tiles.py needs a CUDA GPU", file=sys.stderr)
        return 2
    results = sweep([int(r) for r in args.rows.split(",")], args.quick)
    args.out.write_text(json.dumps(results, indent=2))
    print("| kernel | shape | rows | bf16 ms | picked ms | best ms | floor ms | best tiles |")
    print("|---|---|---|---|---|---|---|---|")
    for r in results:
        tiles = "{block_n}x{block_k} split {split_k} warps {num_warps} stages {num_stages}".format(**r["best"])
        print(f"| {r['kernel']} | {r['shape']} | {r['rows']} | {r['bf16_ms']} | {r['picked_ms']} | {r['best_ms']} "
              f"| {r['floor_ms']} | {tiles} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
