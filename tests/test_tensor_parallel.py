"""Tensor parallelism over an explicit process group, with real processes (gloo on 127.0.0.1).

World of 3: ranks 0 and 1 form the TP group and run TP=2; rank 2 is in the world but not in the group
(like a drafter) and runs the same inputs at TP=1 as the reference. Had any collective used the world
group, rank 2 would never join it and the run would time out.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from datetime import timedelta
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

WORLD, TP = 3, 2
KV_LAYOUT = {"qwen3": (2, 32), "llama": (1, 16)}  # (kv heads, head_dim) of the checkpoints below
HERE = Path(__file__).resolve()


def run_script(runner, lora: str | None = None) -> torch.Tensor:
    """Prefill two sequences, verify drafts next to a decode, roll back and rewrite: all logits. lora: sequence
    a goes through that adapter, b through none."""
    from minedraft.model.runner import SeqInput

    gen = torch.Generator().manual_seed(0)
    ids = lambda n: torch.randint(0, runner.config.vocab_size, (n,), generator=gen).tolist()  # noqa: E731
    a, b = runner.allocate_slot(lora), runner.allocate_slot()
    out = [runner.forward([SeqInput(a, ids(40), 0, num_logits=40), SeqInput(b, ids(25), 0)])]
    out.append(runner.forward([SeqInput(b, ids(1), 25), SeqInput(a, ids(5), 40, num_logits=5)]))
    out.append(runner.forward([SeqInput(a, ids(3), 41, num_logits=3)]))
    return torch.cat(out)


def worker(rank: int, port: int, checkpoints: dict[str, str], out_dir: str) -> None:
    import torch.distributed as dist

    from minedraft.model.lora import LoraOptions
    from minedraft.model.runner import ModelRunner

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=WORLD,
                            timeout=timedelta(seconds=60))
    group = dist.new_group(list(range(TP)))  # every world rank must call new_group, members or not
    tensors = {}
    for name, path in checkpoints.items():
        path, _, adapter = path.partition("+")  # base+adapter: run with that LoRA adapter
        lora = LoraOptions({"x": adapter}) if adapter else None
        runner = ModelRunner(path, num_slots=2, max_seq_len=64, tp_group=group if rank < TP else None, lora=lora)
        tensors[f"{name}.logits"] = run_script(runner, "x" if adapter else None)
        layer = runner.model.model.layers[0]
        tensors[f"{name}.qkv"] = layer.self_attn.qkv_proj.dense_weight()
        tensors[f"{name}.o"] = layer.self_attn.o_proj.dense_weight()
        if hasattr(layer.mlp, "experts"):  # routed experts: each rank holds a slice of every expert
            tensors[f"{name}.w13"], tensors[f"{name}.w2"] = layer.mlp.experts.w13, layer.mlp.experts.w2
        else:
            tensors[f"{name}.gate_up"] = layer.mlp.gate_up_proj.dense_weight()
        tensors[f"{name}.embed"] = runner.model.model.embed_tokens.weight
    save_file({k: v.contiguous() for k, v in tensors.items()}, f"{out_dir}/rank{rank}.safetensors")
    dist.destroy_process_group()


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    from test_lora import make_adapter
    from test_quantization import fp8_pair

    from minedraft.stack.local import free_port

    from tiny_models import make_tiny_checkpoint

    root = tmp_path_factory.mktemp("tp")
    checkpoints = {  # qwen3: 2 kv heads split 1 per rank, vocab 321 not divisible by 2, tied lm head
        "qwen3": make_tiny_checkpoint(root / "qwen3", "qwen3", vocab_size=321, num_heads=4, num_kv_heads=2),
        # llama: 1 kv head replicated on both ranks, biases nowhere, separate lm head
        "llama": make_tiny_checkpoint(root / "llama", "llama3", num_heads=4, num_kv_heads=1, seed=1),
        # qwen3_moe: layer 0 routes to 2 of 4 experts whose intermediate size 32 splits 16 per rank
        "qwen3_moe": make_tiny_checkpoint(root / "qwen3_moe", "qwen3_moe", num_heads=4, num_kv_heads=2, seed=2),
    }
    # the same MoE in block-scaled FP8: each rank dequantizes, then takes its slice
    checkpoints["qwen3_moe_fp8"] = fp8_pair(checkpoints["qwen3_moe"], root / "fp8")[0]
    # LoRA: B split with the column-parallel layers (llama's one kv head replicated), A with the row-parallel ones
    for name in ("qwen3", "llama"):
        checkpoints[f"{name}_lora"] = f"{checkpoints[name]}+{make_adapter(checkpoints[name], root / f'{name}-lora', 1)}"
    args = [str(HERE), str(free_port()), json.dumps({k: str(v) for k, v in checkpoints.items()}), str(root)]
    env = os.environ | {"OMP_NUM_THREADS": "1"}
    procs = [subprocess.Popen([sys.executable, *args[:1], str(rank), *args[1:]], env=env) for rank in range(WORLD)]
    try:
        codes = [p.wait(timeout=240) for p in procs]
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
    assert codes == [0] * WORLD, f"worker exit codes {codes}"
    return checkpoints, [load_file(root / f"rank{r}.safetensors") for r in range(WORLD)]


@pytest.mark.parametrize("name", ["qwen3", "llama", "qwen3_moe", "qwen3_moe_fp8", "qwen3_lora", "llama_lora"])
def test_tp2_logits_match_tp1(results, name):
    _, ranks = results
    tp0, tp1, ref = (r[f"{name}.logits"] for r in ranks)
    assert torch.equal(tp0, tp1), "every TP rank must return the same gathered logits"
    torch.testing.assert_close(tp0, ref, atol=2e-5, rtol=1e-5)


@pytest.mark.parametrize("name", ["qwen3", "llama"])
def test_each_rank_holds_only_its_shard(results, name):
    checkpoints, ranks = results
    full = load_file(Path(checkpoints[name]) / "model.safetensors")
    p = "model.layers.0."
    q, k, v = (full[f"{p}self_attn.{x}_proj.weight"] for x in "qkv")
    gate, up, o = full[f"{p}mlp.gate_proj.weight"], full[f"{p}mlp.up_proj.weight"], full[f"{p}self_attn.o_proj.weight"]
    embed = full["model.embed_tokens.weight"]
    kv_heads, head_dim = KV_LAYOUT[name]
    kv_rows = max(1, kv_heads // TP) * head_dim  # one kv head is replicated, not split
    for rank in range(TP):
        got = ranks[rank]
        qs, kv_start = q.shape[0] // TP, (rank * kv_heads // TP) * head_dim
        expected_qkv = torch.cat([q[rank * qs : (rank + 1) * qs], k[kv_start : kv_start + kv_rows],
                                  v[kv_start : kv_start + kv_rows]])
        assert torch.equal(got[f"{name}.qkv"], expected_qkv)
        inter = gate.shape[0] // TP
        sl = slice(rank * inter, (rank + 1) * inter)
        assert torch.equal(got[f"{name}.gate_up"], torch.cat([gate[sl], up[sl]]))
        cols = o.shape[1] // TP
        assert torch.equal(got[f"{name}.o"], o[:, rank * cols : (rank + 1) * cols])
        rows = -(-embed.shape[0] // TP)
        shard = embed[rank * rows : (rank + 1) * rows]
        assert torch.equal(got[f"{name}.embed"][: len(shard)], shard)
        assert not got[f"{name}.embed"][len(shard) :].any()  # padding rows of the last shard stay zero
    assert ranks[2][f"{name}.qkv"].shape[0] == q.shape[0] + 2 * k.shape[0]  # the TP=1 rank holds everything


if __name__ == "__main__":
    worker(int(sys.argv[1]), int(sys.argv[2]), json.loads(sys.argv[3]), sys.argv[4])


def test_each_rank_holds_its_slice_of_every_expert(results):
    checkpoints, ranks = results
    full = load_file(Path(checkpoints["qwen3_moe"]) / "model.safetensors")
    expert = lambda e, part: full[f"model.layers.0.mlp.experts.{e}.{part}.weight"]  # noqa: E731
    for rank in range(TP):
        w13, w2 = ranks[rank]["qwen3_moe.w13"], ranks[rank]["qwen3_moe.w2"]
        local = w2.shape[2]
        rows = slice(rank * local, (rank + 1) * local)
        for e in range(w13.shape[0]):
            assert torch.equal(w13[e], torch.cat([expert(e, "gate_proj")[rows], expert(e, "up_proj")[rows]]))
            assert torch.equal(w2[e], expert(e, "down_proj")[:, rows])
