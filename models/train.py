#!/usr/bin/env python
"""Train MineDraft's bundled tiny target/draft pair on the Python standard library.

The pair exists so that speculative-decoding benchmarks on a laptop CPU show real
dynamics (partial acceptance, varying accepted lengths); the models are not useful
for anything else.  One run does everything, deterministically for a given seed and
Python version:

1. corpus: the stdlib's own ``.py`` files (no site-packages, no test folders, no
   generated data tables), split into train / held-out by a stable hash of the path;
2. a byte-level BPE tokenizer (``tokenizers``) with ``<|endoftext|>`` as EOS/separator;
3. a ~5.8M-parameter Qwen3 target trained with the plain LM loss;
4. a ~1.0M-parameter Qwen3 draft distilled from the target (KL + hard argmax loss) on
   corpus windows and on target-generated greedy continuations;
5. bf16 safetensors folders, held-out prompts, and a measured greedy acceptance rate
   (direct simulation of speculative decoding with k draft tokens).

Two more drafters are trained from the shipped target by their own phases: a PARD version of the
draft (``--phase pard``), an EAGLE-3 head fed by the target's hidden states (``--phase eagle3``), and
a P-EAGLE version of that head that drafts k tokens in one forward (``--phase p-eagle``). ``--phase lora``
fine-tunes a LoRA pair on one stdlib package: a target adapter and a drafter adapter distilled from the
adapted target.

Budgets are given in optimizer steps (reproducible) with a wall-clock cap per phase
(the CPU is shared); the LR schedule follows whichever bound is nearer, so a run cut
short by the clock still ends with a full LR decay.  Pass ``--*-minutes 0`` to drop
the caps: the run then depends only on the seed (and the stdlib it reads).

Example: ``python models/train.py --out models`` (about 30 min on 2 idle cores).

``python models/train.py smollm2 --phase ...`` trains the drafts of the real model, SmolLM2-135M-Instruct,
instead (models/train_smollm2.py; models/README.md has the commands).
"""

from __future__ import annotations

import os

# Must be set before torch loads OpenMP.  With the default (spinning) wait policy a
# 2-thread run on a 2-core machine that anything else also uses slows down ~15x
# (measured: 4200 -> 270 tokens/s); PASSIVE degrades gracefully to 1-core speed.
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

import argparse  # noqa: E402
import hashlib  # noqa: E402
import json  # noqa: E402
import logging  # noqa: E402
import math  # noqa: E402
import random  # noqa: E402
import sys  # noqa: E402
import sysconfig  # noqa: E402
import time  # noqa: E402
from collections.abc import Callable, Iterator, Sequence  # noqa: E402
from dataclasses import asdict, dataclass, field  # noqa: E402
from pathlib import Path  # noqa: E402

import safetensors.torch  # noqa: E402
import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers  # noqa: E402
from transformers import (  # noqa: E402
    AutoModelForCausalLM,
    GenerationConfig,
    Qwen3Config,
    Qwen3ForCausalLM,
)

EOS = "<|endoftext|>"
TARGET_DIR = "minedraft-target"
DRAFT_DIR = "minedraft-draft"
PARD_DIR = "minedraft-draft-pard"
EAGLE3_DIR = "minedraft-eagle3"
P_EAGLE_DIR = "minedraft-eagle3-parallel"
# PARD's mask token is the byte-level token of byte 0xFF: UTF-8 text never contains that byte, so the
# tokenizer never emits the token and the PARD draft keeps the target's vocabulary as it is.
PARD_MASK = "\u00ff"
PROMPTS_FILE = "prompts/heldout.jsonl"
# Folders whose code we do not train on: third-party packages and test suites.
# Tests are excluded to keep the corpus "library code" and the run short.
EXCLUDED_DIRS = frozenset({"site-packages", "dist-packages", "test", "tests", "idle_test", "__pycache__"})
# Machine-specific generated file (build paths of this interpreter): not portable code.
EXCLUDED_PREFIXES = ("_sysconfigdata",)
# Marker of the 72 generated charmap tables in encodings/ (1.3 MB of "'\x80' # 0x80 -> ..."
# lines): not code, and trivially predictable, which would inflate measured acceptance.
GENERATED_MARKER = "with gencodec.py"

log = logging.getLogger("minedraft.train")


# --------------------------------------------------------------------------- corpus


@dataclass(frozen=True)
class Doc:
    path: str  # relative to the stdlib root, POSIX separators
    text: str


def is_heldout(rel_path: str, heldout_permille: int) -> bool:
    """Stable split: independent of file order, Python hash seed and platform."""
    digest = hashlib.sha256(rel_path.encode("utf-8")).hexdigest()
    return int(digest, 16) % 1000 < heldout_permille


def collect_docs(root: Path, max_file_bytes: int) -> list[Doc]:
    docs = []
    for path in sorted(root.rglob("*.py")):  # sorted: deterministic order
        rel = path.relative_to(root)
        if any(part in EXCLUDED_DIRS for part in rel.parts[:-1]):
            continue
        if rel.name.startswith(EXCLUDED_PREFIXES) or path.stat().st_size > max_file_bytes:
            continue
        try:
            text = path.read_text(encoding="utf-8")
        except UnicodeDecodeError:  # a few legacy files declare other encodings
            continue
        if text.strip() and GENERATED_MARKER not in text[:300]:
            docs.append(Doc(rel.as_posix(), text))
    return docs


def split_docs(docs: Sequence[Doc], heldout_permille: int) -> tuple[list[Doc], list[Doc]]:
    train = [d for d in docs if not is_heldout(d.path, heldout_permille)]
    heldout = [d for d in docs if is_heldout(d.path, heldout_permille)]
    return train, heldout


# ------------------------------------------------------------------------ tokenizer


def train_tokenizer(texts: Sequence[str], vocab_size: int) -> Tokenizer:
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=[EOS],  # id 0
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),  # every byte encodable
        show_progress=False,
    )
    tok.train_from_iterator(texts, trainer=trainer)
    return tok


def encode_stream(tok: Tokenizer, docs: Sequence[Doc], eos_id: int) -> torch.Tensor:
    """All documents as one token stream, each followed by EOS (the document separator)."""
    ids: list[int] = []
    for enc in tok.encode_batch([d.text for d in docs]):
        ids.extend(enc.ids)
        ids.append(eos_id)
    return torch.tensor(ids, dtype=torch.long)


def save_tokenizer(tok: Tokenizer, folder: Path, max_len: int) -> None:
    folder.mkdir(parents=True, exist_ok=True)
    tok.save(str(folder / "tokenizer.json"))
    config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": None,
        "eos_token": EOS,
        "pad_token": EOS,
        "unk_token": None,
        "add_bos_token": False,
        "model_max_length": max_len,
        "clean_up_tokenization_spaces": False,
    }
    (folder / "tokenizer_config.json").write_text(json.dumps(config, indent=2) + "\n")


# --------------------------------------------------------------------------- models


@dataclass(frozen=True)
class Arch:
    hidden: int
    layers: int
    heads: int
    kv_heads: int
    head_dim: int
    ffn: int


TARGET_ARCH = Arch(hidden=256, layers=6, heads=4, kv_heads=2, head_dim=64, ffn=768)
DRAFT_ARCH = Arch(hidden=128, layers=2, heads=4, kv_heads=2, head_dim=32, ffn=512)


def build_model(arch: Arch, vocab_size: int, eos_id: int, max_positions: int) -> Qwen3ForCausalLM:
    config = Qwen3Config(
        vocab_size=vocab_size,
        hidden_size=arch.hidden,
        intermediate_size=arch.ffn,
        num_hidden_layers=arch.layers,
        num_attention_heads=arch.heads,
        num_key_value_heads=arch.kv_heads,
        head_dim=arch.head_dim,
        max_position_embeddings=max_positions,
        rope_parameters={"rope_type": "default", "rope_theta": 10000.0},
        tie_word_embeddings=True,
        bos_token_id=eos_id,
        eos_token_id=eos_id,
        pad_token_id=eos_id,
        dtype="bfloat16",  # recorded in config.json: the dtype we ship
        attn_implementation="sdpa",
    )
    return Qwen3ForCausalLM(config)


def n_params(model: torch.nn.Module) -> int:
    return sum(p.numel() for p in model.parameters())  # tied weights counted once


def save_model(model: Qwen3ForCausalLM, folder: Path, eos_id: int) -> None:
    model.generation_config = GenerationConfig(
        bos_token_id=eos_id, eos_token_id=eos_id, pad_token_id=eos_id, do_sample=False
    )
    # Copy so the caller keeps its fp32 master weights.
    shipped = Qwen3ForCausalLM(model.config)
    shipped.load_state_dict(model.state_dict())
    shipped.generation_config = model.generation_config
    shipped.to(torch.bfloat16).save_pretrained(folder, safe_serialization=True)


def load_model(folder: Path, dtype: torch.dtype = torch.float32) -> torch.nn.Module:
    """Load a shipped folder exactly as users will (fp32 upcast is exact for bf16 weights)."""
    model = AutoModelForCausalLM.from_pretrained(folder, dtype=dtype)
    return model.eval()


# ------------------------------------------------------------------------- training


@dataclass
class Budget:
    """Stop at `steps` or after `minutes`, whichever comes first (minutes <= 0: no clock)."""

    steps: int
    minutes: float
    start: float = field(default_factory=time.monotonic)

    def progress(self, step: int) -> float:
        by_steps = step / self.steps
        if self.minutes <= 0:  # bit-reproducible mode: the schedule depends on steps only
            return by_steps
        return max(by_steps, (time.monotonic() - self.start) / (60 * self.minutes))


def lr_at(step: int, progress: float, peak: float, warmup: int) -> float:
    """Linear warmup, then cosine decay to 10% of peak as progress goes 0 -> 1."""
    warm = min(1.0, (step + 1) / warmup)
    return peak * warm * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * min(1.0, progress))))


def random_windows(stream: torch.Tensor, batch: int, length: int, gen: torch.Generator) -> torch.Tensor:
    starts = torch.randint(0, len(stream) - length, (batch,), generator=gen)
    return torch.stack([stream[s : s + length] for s in starts.tolist()])


def lm_loss(model: torch.nn.Module, x: torch.Tensor) -> torch.Tensor:
    logits = model(input_ids=x[:, :-1]).logits.float()
    return F.cross_entropy(logits.reshape(-1, logits.size(-1)), x[:, 1:].reshape(-1))


def train_loop(
    model: torch.nn.Module,
    next_batch: Callable[[], torch.Tensor],
    loss_fn: Callable[[torch.Tensor], torch.Tensor],
    budget: Budget,
    peak_lr: float,
    name: str,
    log_every: int,
) -> dict[str, float]:
    model.train()
    decay = [p for p in model.parameters() if p.dim() >= 2]
    no_decay = [p for p in model.parameters() if p.dim() < 2]  # norms: no weight decay
    opt = torch.optim.AdamW(
        [{"params": decay, "weight_decay": 0.1}, {"params": no_decay, "weight_decay": 0.0}],
        lr=peak_lr,
        betas=(0.9, 0.95),
    )
    warmup = max(1, min(100, budget.steps // 10))
    step, ema = 0, None
    while (progress := budget.progress(step)) < 1.0:
        for group in opt.param_groups:
            group["lr"] = lr_at(step, progress, peak_lr, warmup)
        # bf16 autocast: ~1.5x faster on AVX512-BF16 CPUs; master weights stay fp32.
        with torch.autocast("cpu", dtype=torch.bfloat16):
            loss = loss_fn(next_batch())
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        step += 1
        ema = loss.item() if ema is None else 0.95 * ema + 0.05 * loss.item()
        if step % log_every == 0:
            elapsed = time.monotonic() - budget.start
            log.info("%s step %d/%d  loss(ema) %.4f  lr %.2e  %.0fs", name, step, budget.steps, ema,
                     opt.param_groups[0]["lr"], elapsed)
    model.eval()
    stopped_by = "steps" if step >= budget.steps else "clock"
    log.info("%s done: %d steps in %.0fs (stopped by %s)", name, step, time.monotonic() - budget.start,
             stopped_by)
    return {"steps": step, "seconds": round(time.monotonic() - budget.start, 1), "stopped_by": stopped_by}


def distill_loss(teacher: torch.nn.Module, student: torch.nn.Module, hard_weight: float
                 ) -> Callable[[torch.Tensor], torch.Tensor]:
    """KL(teacher || student) per position, plus CE on the teacher's argmax.

    The hard term targets what speculative decoding actually needs under greedy
    verification: the student's top-1 must equal the teacher's top-1.
    """

    def loss(x: torch.Tensor) -> torch.Tensor:
        inputs = x[:, :-1]
        with torch.no_grad():
            t_logp = F.log_softmax(teacher(input_ids=inputs).logits.float(), dim=-1)
        s_logits = student(input_ids=inputs).logits.float()
        s_logp = F.log_softmax(s_logits, dim=-1)
        kl = (t_logp.exp() * (t_logp - s_logp)).sum(-1).mean()
        hard = F.cross_entropy(s_logits.reshape(-1, s_logits.size(-1)), t_logp.argmax(-1).reshape(-1))
        return kl + hard_weight * hard

    return loss


@torch.no_grad()
def greedy_extend(model: torch.nn.Module, prompt: torch.Tensor, new_tokens: int) -> torch.Tensor:
    """Greedy continuation of a [B, P] batch with a KV cache; returns [B, P + new_tokens]."""
    out = model(input_ids=prompt, use_cache=True, logits_to_keep=1)
    pieces = [prompt]
    for i in range(new_tokens):
        nxt = out.logits[:, -1].argmax(-1, keepdim=True)
        pieces.append(nxt)
        if i + 1 < new_tokens:
            out = model(input_ids=nxt, past_key_values=out.past_key_values, use_cache=True)
    return torch.cat(pieces, dim=1)


def generate_distill_set(
    teacher: torch.nn.Module, stream: torch.Tensor, args: argparse.Namespace, gen: torch.Generator
) -> torch.Tensor:
    """Target-greedy continuations of random training prompts, as [N, seq_len + 1] windows.

    At benchmark time the draft sees prompt + *target-generated* text, which is far
    more repetitive than the corpus; training on it closes that distribution gap.
    """
    length = args.seq_len + 1
    rows: list[torch.Tensor] = []
    start = time.monotonic()
    deadline = start + 60 * args.gen_minutes if args.gen_minutes > 0 else math.inf
    while len(rows) * args.gen_batch < args.gen_seqs and time.monotonic() < deadline:
        plen = int(torch.randint(16, args.max_prompt_tokens + 1, (1,), generator=gen))
        prompts = random_windows(stream, args.gen_batch, plen, gen)
        rows.append(greedy_extend(teacher, prompts, length - plen))
        log.info("generated %d/%d sequences (prompt %d tokens)  %.0fs", len(rows) * args.gen_batch,
                 args.gen_seqs, plen, time.monotonic() - start)
    return torch.cat(rows) if rows else torch.empty(0, length, dtype=torch.long)


def mixed_batches(
    stream: torch.Tensor, generated: torch.Tensor, args: argparse.Namespace, gen: torch.Generator
) -> Iterator[torch.Tensor]:
    """Batches of corpus windows with a fraction `gen_mix` replaced by generated rows."""
    n_gen = round(args.batch * args.gen_mix) if len(generated) else 0
    while True:
        corpus = random_windows(stream, args.batch - n_gen, args.seq_len + 1, gen)
        rows = generated[torch.randint(0, max(1, len(generated)), (n_gen,), generator=gen)]
        yield torch.cat([corpus, rows])


# --------------------------------------------------------------------------- PARD


def pard_layout(inputs: torch.Tensor, anchors: torch.Tensor, depth: int, mask_id: int
                ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """One PARD training row per input row: the real tokens, then for each anchor t a chain of `depth`
    mask tokens at positions t+1 .. t+depth.

    Mask j of a chain sees the real tokens up to t and the chain's masks before it, exactly what it sees
    when the draft proposes k tokens in one forward, and learns the token after position t+j: so each
    token's target is the teacher's prediction at its own position id. Returns (input ids, position ids,
    a boolean [B, 1, T, T] attention mask, True = attend).
    """
    batch, length = inputs.shape
    steps = torch.arange(1, depth + 1)
    mask_pos = (anchors[:, :, None] + steps).flatten(1)  # [B, A * depth]
    pos = torch.cat([torch.arange(length).expand(batch, -1), mask_pos], dim=1)
    ids = torch.cat([inputs, torch.full_like(mask_pos, mask_id)], dim=1)
    is_real = torch.arange(pos.size(1)) < length
    chain = torch.cat([torch.full((length,), -1), torch.arange(anchors.size(1)).repeat_interleave(depth)])
    sees_real_up_to = torch.cat([pos[:, :length], anchors.repeat_interleave(depth, dim=1)], dim=1)
    real_key = is_real[None, None, :] & (pos[:, None, :] <= sees_real_up_to[:, :, None])
    same_chain = (chain[None, :, None] == chain[None, None, :]) & ~is_real[None, None, :]
    chain_key = same_chain & (pos[:, None, :] <= pos[:, :, None])
    return ids, pos, (real_key | chain_key)[:, None]


def pard_loss(teacher: torch.nn.Module, student: torch.nn.Module, mask_id: int, args: argparse.Namespace,
              gen: torch.Generator) -> Callable[[torch.Tensor], torch.Tensor]:
    """The draft recipe's KL + hard loss at every real position and at every mask of `pard_anchors` random
    chains per row (all anchors kept: at this scale the whole chain costs little)."""

    def loss(x: torch.Tensor) -> torch.Tensor:
        inputs = x[:, :-1]
        with torch.no_grad():
            t_logp = F.log_softmax(teacher(input_ids=inputs).logits.float(), dim=-1)
        room = inputs.size(1) - args.pard_depth
        anchors = torch.rand(inputs.size(0), room, generator=gen).argsort(dim=1)[:, : args.pard_anchors]
        ids, pos, attend = pard_layout(inputs, anchors, args.pard_depth, mask_id)
        s_logits = student(input_ids=ids, position_ids=pos, attention_mask=attend).logits.float()
        s_logp = F.log_softmax(s_logits, dim=-1)
        t_logp = t_logp.gather(1, pos[..., None].expand(-1, -1, t_logp.size(-1)))
        kl = (t_logp.exp() * (t_logp - s_logp)).sum(-1).mean()
        hard = F.cross_entropy(s_logits.flatten(0, 1), t_logp.argmax(-1).flatten())
        return kl + args.hard_weight * hard

    return loss


@torch.no_grad()
def pard_propose(draft: torch.nn.Module, ctx: torch.Tensor, k: int, mask_id: int) -> torch.Tensor:
    """k greedy draft tokens from one forward over [ctx, mask x (k - 1)]."""
    ids = torch.cat([ctx, torch.full((1, k - 1), mask_id)], dim=1)
    return draft(input_ids=ids, logits_to_keep=k).logits[:, -k:].argmax(-1)


def train_pard(out: Path, tok: Tokenizer, train_stream: torch.Tensor, args: argparse.Namespace,
               gen: torch.Generator) -> dict:
    """PARD: the shipped draft, fine-tuned to propose k tokens in one forward; saved with its mask token."""
    mask_id = tok.token_to_id(PARD_MASK)
    teacher = load_model(out / TARGET_DIR, torch.bfloat16)
    generated = generate_distill_set(teacher, train_stream, args, gen)
    batches = mixed_batches(train_stream, generated, args, gen)
    draft = load_model(out / DRAFT_DIR)
    draft.config.pard_token = mask_id  # read by MineDraft (and vLLM) as the mask token
    run = train_loop(draft, lambda: next(batches), pard_loss(teacher, draft, mask_id, args, gen),
                     Budget(args.pard_steps, args.pard_minutes), args.pard_lr, "pard", args.log_every)
    save_model(draft, out / PARD_DIR, tok.token_to_id(EOS))
    save_tokenizer(tok, out / PARD_DIR, args.max_positions)
    return {"pard_token": mask_id, "pard_training": run, "pard_generated_rows": len(generated)}


# ------------------------------------------------------------------------- EAGLE-3


EAGLE3_AUX_LAYERS = (1, 3, 5)  # target layers whose INPUT residual stream feeds the head (low, middle, high)


@dataclass(frozen=True)
class Eagle3Arch:
    hidden: int = 256  # = the target's hidden size
    ffn: int = 768  # = the target's, so the MLP can start from the target's last layer
    heads: int = 4
    kv_heads: int = 2
    head_dim: int = 64
    vocab: int = 4096
    draft_vocab: int = 4096
    eps: float = 1e-6
    rope_theta: float = 10000.0


class RMSNorm(torch.nn.Module):
    def __init__(self, size: int, eps: float) -> None:
        super().__init__()
        self.weight = torch.nn.Parameter(torch.ones(size))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        xf = x.float()  # the statistics in float32 whatever the autocast dtype
        return (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps) * self.weight.float()).to(x.dtype)


def linear(n_in: int, n_out: int) -> torch.nn.Linear:
    layer = torch.nn.Linear(n_in, n_out, bias=False)
    torch.nn.init.normal_(layer.weight, std=0.02)
    return layer


class Eagle3Attention(torch.nn.Module):
    """Llama attention over the 2H input [normed embeds, normed hidden]: GQA, RoPE, no q/k norm, no biases."""

    def __init__(self, arch: Eagle3Arch) -> None:
        super().__init__()
        self.arch = arch
        self.q_proj = linear(2 * arch.hidden, arch.heads * arch.head_dim)
        self.k_proj = linear(2 * arch.hidden, arch.kv_heads * arch.head_dim)
        self.v_proj = linear(2 * arch.hidden, arch.kv_heads * arch.head_dim)
        self.o_proj = linear(arch.heads * arch.head_dim, arch.hidden)

    def rope(self, x: torch.Tensor, pos: torch.Tensor) -> torch.Tensor:
        """Rotate-half RoPE of x [B, heads, T, d] at positions pos [T] or [B, T]."""
        d = self.arch.head_dim
        inv_freq = self.arch.rope_theta ** (-torch.arange(0, d, 2, dtype=torch.float32, device=x.device) / d)
        angles = pos.float()[..., None] * inv_freq
        angles = torch.cat([angles, angles], dim=-1)
        if angles.dim() == 3:  # per-row positions: broadcast over heads
            angles = angles[:, None]
        x1, x2 = x.float().chunk(2, dim=-1)
        rotated = torch.cat([-x2, x1], dim=-1)
        return (x.float() * angles.cos() + rotated * angles.sin()).to(x.dtype)

    def qkv(self, a: torch.Tensor, pos: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        b, t, _ = a.shape
        d = self.arch.head_dim
        q = self.q_proj(a).view(b, t, -1, d).transpose(1, 2)
        k = self.k_proj(a).view(b, t, -1, d).transpose(1, 2)
        v = self.v_proj(a).view(b, t, -1, d).transpose(1, 2)
        return self.rope(q, pos), self.rope(k, pos), v

    def attend(self, q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, mask: torch.Tensor | None
               ) -> torch.Tensor:
        out = F.scaled_dot_product_attention(q, keys.to(q.dtype), values.to(q.dtype), attn_mask=mask,
                                             enable_gqa=True)
        return self.o_proj(out.transpose(1, 2).flatten(2))


class Eagle3MLP(torch.nn.Module):
    def __init__(self, arch: Eagle3Arch) -> None:
        super().__init__()
        self.gate_proj = linear(arch.hidden, arch.ffn)
        self.up_proj = linear(arch.hidden, arch.ffn)
        self.down_proj = linear(arch.ffn, arch.hidden)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class Eagle3Layer(torch.nn.Module):
    def __init__(self, arch: Eagle3Arch) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(arch.hidden, arch.eps)
        self.hidden_norm = RMSNorm(arch.hidden, arch.eps)
        self.self_attn = Eagle3Attention(arch)
        self.post_attention_layernorm = RMSNorm(arch.hidden, arch.eps)
        self.mlp = Eagle3MLP(arch)


class Eagle3Head(torch.nn.Module):
    """The EAGLE-3 draft head in the published layout (``fc``, ``midlayer.*``, ``norm``, ``lm_head``,
    ``d2t``/``t2d``). It reads token embeddings from the target's frozen embedding table, which is not
    part of its state dict.

    One position: g = fc(aux) or the previous step's output; a = [input_layernorm(embed(x)),
    hidden_norm(g)]; h = g + o_proj(attn(a)); out = h + mlp(post_attention_layernorm(h));
    logits = lm_head(norm(out)); ``out`` is the hidden input of the next drafting step.
    """

    def __init__(self, arch: Eagle3Arch, embed: torch.Tensor) -> None:
        super().__init__()
        self.arch = arch
        self.fc = linear(len(EAGLE3_AUX_LAYERS) * arch.hidden, arch.hidden)
        self.midlayer = Eagle3Layer(arch)
        self.norm = RMSNorm(arch.hidden, arch.eps)
        self.lm_head = linear(arch.hidden, arch.draft_vocab)
        self.register_buffer("embed", embed.detach().float().clone(), persistent=False)
        # Draft vocabulary = target vocabulary here: target id = draft id + d2t[draft id] = draft id.
        self.register_buffer("d2t", torch.zeros(arch.draft_vocab, dtype=torch.long))
        self.register_buffer("t2d", torch.ones(arch.vocab, dtype=torch.bool))

    def qkv(self, tokens: torch.Tensor, hidden: torch.Tensor, pos: torch.Tensor
            ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        layer = self.midlayer
        a = torch.cat([layer.input_layernorm(self.embed[tokens]), layer.hidden_norm(hidden)], dim=-1)
        return layer.self_attn.qkv(a, pos)

    def finish(self, hidden: torch.Tensor, q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor,
               mask: torch.Tensor | None) -> torch.Tensor:
        layer = self.midlayer
        h = hidden + layer.self_attn.attend(q, keys, values, mask)
        return h + layer.mlp(layer.post_attention_layernorm(h))

    def logits(self, out: torch.Tensor) -> torch.Tensor:
        return self.lm_head(self.norm(out))

    def to_target_ids(self, draft_ids: torch.Tensor) -> torch.Tensor:
        return draft_ids + self.d2t[draft_ids]


def aux_hidden(target: torch.nn.Module, ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(target logits, the residual streams entering the layers in EAGLE3_AUX_LAYERS, concatenated)."""
    out = target(input_ids=ids, output_hidden_states=True)
    # hidden_states[i] is the input of decoder layer i (element 0: the embeddings).
    return out.logits, torch.cat([out.hidden_states[i] for i in EAGLE3_AUX_LAYERS], dim=-1)


def head_from_target(target: torch.nn.Module, arch: Eagle3Arch) -> Eagle3Head:
    """A fresh head whose output side (norm, lm_head) starts as the target's, so that it predicts in the
    target's token space from the first step; fc and the midlayer start random."""
    head = Eagle3Head(arch, target.get_input_embeddings().weight)
    with torch.no_grad():
        head.lm_head.weight.copy_(target.lm_head.weight)
        head.norm.weight.copy_(target.model.norm.weight)
    return head


def causal_mask(length: int, device: torch.device | None = None) -> torch.Tensor:
    return torch.ones(length, length, dtype=torch.bool, device=device).tril()


def ttt_mask(length: int, step: int, device: torch.device | None = None) -> torch.Tensor:
    """Attention of chain step `step` (one query per anchor a, at position a + step) over
    [step-0 keys; keys of chain steps 1..step]: step-0 keys at positions <= a, and the same anchor's
    own chain keys (the diagonal of each chain block). True = attend."""
    eye = torch.eye(length, dtype=torch.bool, device=device)
    return torch.cat([causal_mask(length, device)] + [eye] * step, dim=1)


def ttt_steps(head: Eagle3Head, x: torch.Tensor, aux: torch.Tensor, greedy: torch.Tensor, depth: int
              ) -> Iterator[torch.Tensor]:
    """The head's output per anchor for steps 0 .. depth - 1 of the training-time test, each [B, length, H].

    Every position of x[:, :-1] is an anchor a. Step 0 is the teacher-forced pass over the target's
    features: (fc(aux_a), x_{a + 1}) at position a. Chain step j puts at position a + j the query with
    hidden = step j - 1's output for the same anchor and token = greedy[a + j], the target's greedy token
    (what the drafter holds whenever the chain so far was accepted); it attends to step-0 keys at positions
    <= a and to the anchor's own chain keys (`ttt_mask`). Anchors with a + j >= length are padding.
    """
    length = x.size(1) - 1
    anchors = torch.arange(length, device=x.device)
    hidden = head.fc(aux[:, :length])
    keys: list[torch.Tensor] = []
    values: list[torch.Tensor] = []
    for j in range(depth):
        tokens = x[:, 1:] if j == 0 else F.pad(greedy[:, j:], (0, j - 1))
        q, k, v = head.qkv(tokens, hidden, anchors + j)
        keys.append(k)
        values.append(v)
        hidden = head.finish(hidden, q, torch.cat(keys, 2), torch.cat(values, 2), ttt_mask(length, j, x.device))
        yield hidden


def eagle3_loss(teacher: torch.nn.Module, head: Eagle3Head, args: argparse.Namespace
                ) -> Callable[[torch.Tensor], torch.Tensor]:
    """The training-time test (`ttt_steps`) over every anchor of a row. Step j's output for anchor a
    predicts token a + j + 2 and is distilled from the target's logits at a + j + 1 (KL + hard_weight x
    CE on the target's argmax), weighted eagle3_decay ** j."""

    def loss(x: torch.Tensor) -> torch.Tensor:
        length = x.size(1) - 1
        with torch.no_grad():
            t_logits, aux = aux_hidden(teacher, x)
            t_logp = F.log_softmax(t_logits.float(), dim=-1)  # [B, length + 1, V]
            greedy = t_logp.argmax(-1)  # greedy[p]: the target's token after position p
        total = x.new_zeros((), dtype=torch.float32)
        for j, out in enumerate(ttt_steps(head, x, aux.float(), greedy, args.eagle3_depth)):
            s_logits = head.logits(out)[:, : length - j].float()
            s_logp = F.log_softmax(s_logits, dim=-1)
            target_logp = t_logp[:, j + 1 :]
            kl = (target_logp.exp() * (target_logp - s_logp)).sum(-1).mean()
            hard = F.cross_entropy(s_logits.flatten(0, 1), greedy[:, j + 1 :].flatten())
            total = total + args.eagle3_decay ** j * (kl + args.hard_weight * hard)
        return total

    return loss


@torch.no_grad()
def eagle3_propose(target: torch.nn.Module, head: Eagle3Head, ctx: torch.Tensor, k: int) -> torch.Tensor:
    """k greedy draft tokens after ctx = t_0..t_n, drafted as the engine does: position p holds
    (fc(aux_p), t_{p + 1}) for p < n; then one position per chain step, fed the previous output."""
    _, aux = aux_hidden(target, ctx)
    n = ctx.size(1) - 1
    hidden = head.fc(aux[:, :n])
    q, key, value = head.qkv(ctx[:, 1:], hidden, torch.arange(n, device=ctx.device))
    keys, values = [key], [value]
    last = head.finish(hidden, q, key, value, causal_mask(n, ctx.device))[:, -1:]
    drafted = [head.to_target_ids(head.logits(last).argmax(-1))]
    for j in range(1, k):
        q, key, value = head.qkv(drafted[-1], last, torch.tensor([n - 1 + j], device=ctx.device))
        keys.append(key)
        values.append(value)
        last = head.finish(last, q, torch.cat(keys, 2), torch.cat(values, 2), None)
        drafted.append(head.to_target_ids(head.logits(last).argmax(-1)))
    return torch.cat(drafted, dim=1)


@torch.no_grad()
def eagle3_top1(target: torch.nn.Module, head: Eagle3Head, ctx: torch.Tensor, start: int) -> torch.Tensor:
    """The head's teacher-forced next-token guesses for ctx[start:] (position p guesses token p + 2)."""
    _, aux = aux_hidden(target, ctx[:, :-1])
    n = ctx.size(1) - 2
    hidden = head.fc(aux[:, :n])
    q, key, value = head.qkv(ctx[:, 1:-1], hidden, torch.arange(n, device=ctx.device))
    out = head.finish(hidden, q, key, value, causal_mask(n, ctx.device))
    return head.to_target_ids(head.logits(out)[0, start - 2 :].argmax(-1))


def eagle3_config(arch: Eagle3Arch, max_positions: int, eos_id: int) -> dict:
    rope = {"rope_theta": arch.rope_theta, "rope_type": "default"}
    return {
        "architectures": ["LlamaForCausalLMEagle3"],
        "model_type": "llama",
        "hidden_size": arch.hidden,
        "intermediate_size": arch.ffn,
        "num_hidden_layers": 1,
        "num_attention_heads": arch.heads,
        "num_key_value_heads": arch.kv_heads,
        "head_dim": arch.head_dim,
        "hidden_act": "silu",
        "attention_bias": False,
        "mlp_bias": False,
        "rms_norm_eps": arch.eps,
        "rope_theta": arch.rope_theta,
        "rope_parameters": rope,
        "max_position_embeddings": max_positions,
        "vocab_size": arch.vocab,
        "draft_vocab_size": arch.draft_vocab,
        "tie_word_embeddings": False,
        "eagle_aux_hidden_state_layer_ids": list(EAGLE3_AUX_LAYERS),
        "bos_token_id": eos_id,
        "eos_token_id": eos_id,
        "pad_token_id": eos_id,
        "torch_dtype": "bfloat16",
        "dtype": "bfloat16",
    }


def save_eagle3(head: Eagle3Head, folder: Path, max_positions: int, eos_id: int) -> None:
    """config.json + model.safetensors: float weights in bf16, d2t (int64) and t2d (bool) as they are, or
    left out when they are the identity (draft vocabulary = target vocabulary), which is what a head without
    them means and what vLLM accepts."""
    folder.mkdir(parents=True, exist_ok=True)
    tensors = {name: (t.to(torch.bfloat16) if t.is_floating_point() else t).contiguous()
               for name, t in head.state_dict().items()}
    if not tensors["d2t"].any() and tensors["t2d"].all() and len(tensors["d2t"]) == len(tensors["t2d"]):
        del tensors["d2t"], tensors["t2d"]
    safetensors.torch.save_file(tensors, str(folder / "model.safetensors"), metadata={"format": "pt"})
    config = eagle3_config(head.arch, max_positions, eos_id)
    (folder / "config.json").write_text(json.dumps(config, indent=2) + "\n")


def eagle3_arch(folder: Path) -> Eagle3Arch:
    config = json.loads((folder / "config.json").read_text())
    return Eagle3Arch(hidden=config["hidden_size"], ffn=config["intermediate_size"],
                      heads=config["num_attention_heads"], kv_heads=config["num_key_value_heads"],
                      head_dim=config["head_dim"], vocab=config["vocab_size"],
                      draft_vocab=config["draft_vocab_size"], eps=config["rms_norm_eps"],
                      rope_theta=config["rope_theta"])


def load_eagle3_weights(folder: Path) -> dict[str, torch.Tensor]:
    """The head's tensors in float32; identity vocabulary maps where the checkpoint has none."""
    weights = safetensors.torch.load_file(str(folder / "model.safetensors"))
    arch = eagle3_arch(folder)
    weights.setdefault("d2t", torch.zeros(arch.draft_vocab, dtype=torch.long))
    weights.setdefault("t2d", torch.ones(arch.vocab, dtype=torch.bool))
    return {name: t.float() if t.is_floating_point() else t for name, t in weights.items()}


def load_eagle3(folder: Path, target: torch.nn.Module) -> Eagle3Head:
    head = Eagle3Head(eagle3_arch(folder), target.get_input_embeddings().weight)
    head.load_state_dict(load_eagle3_weights(folder))
    return head.eval()


def train_eagle3(out: Path, tok: Tokenizer, train_stream: torch.Tensor, args: argparse.Namespace,
                 gen: torch.Generator) -> dict:
    """EAGLE-3 head for the shipped target, trained with the training-time test on the draft recipe's mix
    of corpus windows and target-greedy continuations; the teacher is the shipped bf16 target."""
    teacher = load_model(out / TARGET_DIR, torch.bfloat16)
    for p in teacher.parameters():
        p.requires_grad_(False)
    generated = generate_distill_set(teacher, train_stream, args, gen)
    batches = mixed_batches(train_stream, generated, args, gen)
    head = head_from_target(load_model(out / TARGET_DIR), Eagle3Arch(vocab=tok.get_vocab_size(),
                                                                     draft_vocab=tok.get_vocab_size()))
    if not args.eagle3_train_lm_head:  # EAGLE-1/2's choice: the target's own LM head, frozen
        head.lm_head.weight.requires_grad_(False)
    log.info("eagle3 head: %d parameters (the target's embedding not counted)", n_params(head))
    run = train_loop(head, lambda: next(batches), eagle3_loss(teacher, head, args),
                     Budget(args.eagle3_steps, args.eagle3_minutes), args.eagle3_lr, "eagle3", args.log_every)
    save_eagle3(head, out / EAGLE3_DIR, args.max_positions, tok.token_to_id(EOS))
    return {"eagle3_training": run, "eagle3_generated_rows": len(generated), "eagle3_parameters": n_params(head)}


# ------------------------------------------------------------------------- P-EAGLE


class PEagleHead(Eagle3Head):
    """An EAGLE-3 head that also drafts in one forward (P-EAGLE): every masked position carries the mask
    token and fc(``mask_hidden``), a learned stand-in for the target features it does not have yet."""

    def __init__(self, arch: Eagle3Arch, embed: torch.Tensor) -> None:
        super().__init__(arch, embed)
        self.mask_hidden = torch.nn.Parameter(torch.zeros(1, len(EAGLE3_AUX_LAYERS) * arch.hidden))


def p_eagle_forward(head: PEagleHead, tokens: torch.Tensor, aux: torch.Tensor, is_mask: torch.Tensor,
                    pos: torch.Tensor, attend: torch.Tensor | None) -> torch.Tensor:
    """The head's outputs over one window: real positions take fc(aux), masked ones fc(mask_hidden)."""
    mask_hidden = head.mask_hidden.to(aux.dtype).expand(*aux.shape[:2], -1)
    hidden = head.fc(torch.where(is_mask[..., None], mask_hidden, aux))
    q, key, value = head.qkv(tokens, hidden, pos)
    return head.finish(hidden, q, key, value, attend)


def p_eagle_loss(teacher: torch.nn.Module, head: PEagleHead, mask_id: int, args: argparse.Namespace,
                 gen: torch.Generator) -> Callable[[torch.Tensor], torch.Tensor]:
    """One pass over a row's real positions (position p: token x_{p + 1}, fc(aux_p)) followed by
    `p_eagle_anchors` random chains of `p_eagle_depth` masks (`pard_layout`). Every position p predicts the
    target's token after p + 1 (KL + hard_weight x CE on the argmax); the real positions' mean loss (d_1)
    and the masks' mean loss (d_2..) are added with weights 1 and `p_eagle_mask_weight`."""

    def loss(x: torch.Tensor) -> torch.Tensor:
        length = x.size(1) - 1
        with torch.no_grad():
            t_logits, aux = aux_hidden(teacher, x)
            t_logp = F.log_softmax(t_logits.float(), dim=-1)  # [B, length + 1, V]
        room = length - args.p_eagle_depth
        anchors = torch.rand(x.size(0), room, generator=gen).argsort(dim=1)[:, : args.p_eagle_anchors]
        ids, pos, attend = pard_layout(x[:, 1:], anchors, args.p_eagle_depth, mask_id)
        is_mask = torch.arange(ids.size(1)) >= length
        aux_at = aux.float().gather(1, pos[..., None].clamp(max=length - 1).expand(-1, -1, aux.size(-1)))
        out = p_eagle_forward(head, ids, aux_at, is_mask.expand(x.size(0), -1), pos, attend)
        s_logp = F.log_softmax(head.logits(out).float(), dim=-1)
        target_logp = t_logp.gather(1, (pos + 1)[..., None].expand(-1, -1, t_logp.size(-1)))
        per_pos = (target_logp.exp() * (target_logp - s_logp)).sum(-1)
        per_pos = per_pos - args.hard_weight * s_logp.gather(-1, target_logp.argmax(-1, keepdim=True))[..., 0]
        return per_pos[:, :length].mean() + args.p_eagle_mask_weight * per_pos[:, length:].mean()

    return loss


@torch.no_grad()
def mean_aux(teacher: torch.nn.Module, batches: Iterator[torch.Tensor], count: int) -> torch.Tensor:
    """The target's aux features averaged over `count` training batches: mask_hidden's starting point."""
    return torch.stack([aux_hidden(teacher, next(batches))[1].float().mean((0, 1)) for _ in range(count)]).mean(0)


@torch.no_grad()
def p_eagle_propose(target: torch.nn.Module, head: PEagleHead, ctx: torch.Tensor, k: int, mask_id: int
                    ) -> torch.Tensor:
    """k greedy draft tokens after ctx = t_0..t_n in one head forward, as the engine drafts: positions
    p < n hold (fc(aux_p), t_{p + 1}), then k - 1 masked positions; causal attention."""
    _, aux = aux_hidden(target, ctx)
    n = ctx.size(1) - 1
    tokens = torch.cat([ctx[:, 1:], torch.full((1, k - 1), mask_id)], dim=1)
    aux = torch.cat([aux[:, :n].float(), aux.new_zeros(1, k - 1, aux.size(-1)).float()], dim=1)
    is_mask = torch.arange(n + k - 1) >= n
    out = p_eagle_forward(head, tokens, aux, is_mask[None], torch.arange(n + k - 1), causal_mask(n + k - 1))
    return head.to_target_ids(head.logits(out[:, n - 1 :]).argmax(-1))


def save_p_eagle(head: PEagleHead, folder: Path, max_positions: int, eos_id: int, mask_id: int) -> None:
    """The EAGLE-3 files (mask_hidden among the tensors), with the mask token named in config.json."""
    save_eagle3(head, folder, max_positions, eos_id)
    config = json.loads((folder / "config.json").read_text())
    config["mask_token_id"] = mask_id
    (folder / "config.json").write_text(json.dumps(config, indent=2) + "\n")


def load_p_eagle(folder: Path, target: torch.nn.Module) -> tuple[PEagleHead, int]:
    """(the head, its mask token id)."""
    eagle = load_eagle3_weights(folder)
    head = PEagleHead(eagle3_arch(folder), target.get_input_embeddings().weight)
    head.load_state_dict(eagle)
    return head.eval(), json.loads((folder / "config.json").read_text())["mask_token_id"]


def train_p_eagle(out: Path, tok: Tokenizer, train_stream: torch.Tensor, args: argparse.Namespace,
                  gen: torch.Generator) -> dict:
    """P-EAGLE: the shipped EAGLE-3 head plus mask_hidden (started at the mean aux features), fine-tuned on
    the EAGLE-3 data mix to draft k tokens in one forward; the teacher is the shipped bf16 target."""
    mask_id = tok.token_to_id(PARD_MASK)
    teacher = load_model(out / TARGET_DIR, torch.bfloat16)
    for p in teacher.parameters():
        p.requires_grad_(False)
    generated = generate_distill_set(teacher, train_stream, args, gen)
    batches = mixed_batches(train_stream, generated, args, gen)
    head = PEagleHead(eagle3_arch(out / EAGLE3_DIR), teacher.get_input_embeddings().weight.float())
    head.load_state_dict({**load_eagle3_weights(out / EAGLE3_DIR), "mask_hidden": mean_aux(teacher, batches, 4)[None]})
    if not args.eagle3_train_lm_head:  # as the EAGLE-3 head: the target's LM head, frozen
        head.lm_head.weight.requires_grad_(False)
    run = train_loop(head, lambda: next(batches), p_eagle_loss(teacher, head, mask_id, args, gen),
                     Budget(args.p_eagle_steps, args.p_eagle_minutes), args.p_eagle_lr, "p-eagle", args.log_every)
    save_p_eagle(head, out / P_EAGLE_DIR, args.max_positions, tok.token_to_id(EOS), mask_id)
    return {"p_eagle_training": run, "p_eagle_generated_rows": len(generated), "mask_token_id": mask_id}


# ---------------------------------------------------------------------------- LoRA pair


LORA_PROJECTIONS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
LORA_PROMPTS_FILE = "prompts/lora-{domain}.jsonl"
# Shares of --lora-minutes: the target adapter, the adapted target's greedy rows, the drafter adapter.
LORA_SHARES = (0.4, 0.2, 0.4)


def lora_dirs(domain: str) -> tuple[str, str]:
    return f"minedraft-target-lora-{domain}", f"minedraft-draft-lora-{domain}"


def in_domain(doc: Doc, domain: str) -> bool:
    return doc.path.startswith(domain + "/")


def with_lora(model: torch.nn.Module, rank: int) -> torch.nn.Module:
    """`model` with a fresh PEFT LoRA (rank r, alpha 2r) on the seven projections of every layer; only the
    adapter trains."""
    from peft import LoraConfig, get_peft_model

    config = LoraConfig(r=rank, lora_alpha=2 * rank, lora_dropout=0.0, target_modules=LORA_PROJECTIONS)
    return get_peft_model(model, config)


def save_lora(model: torch.nn.Module, folder: Path, base: str) -> None:
    """The adapter alone in PEFT's format (adapter_config.json + adapter_model.safetensors), bf16 like the
    shipped models; its config names the base as the bundled folder's name (not this machine's path), and
    PEFT's generated model card is left out."""
    weights = {k: v.detach().to(torch.bfloat16) for k, v in model.state_dict().items() if "lora_" in k}
    model.peft_config["default"].base_model_name_or_path = base
    model.save_pretrained(folder, safe_serialization=True, state_dict=weights)
    (folder / "README.md").unlink(missing_ok=True)


def load_adapted(base: Path, adapter: Path, dtype: torch.dtype = torch.float32) -> torch.nn.Module:
    """`base` with the shipped `adapter` merged into its weights (PEFT's merge_and_unload), as served."""
    from peft import PeftModel

    return PeftModel.from_pretrained(load_model(base), adapter).merge_and_unload().to(dtype).eval()


def domain_prompts(heldout: Sequence[Doc], tok: Tokenizer, args: argparse.Namespace) -> list[dict[str, str]]:
    """Held-out prompts of the domain (cut from its held-out files like prompts/heldout.jsonl's)."""
    docs = [d for d in heldout if in_domain(d, args.lora_domain)]
    if not docs:
        raise SystemExit(f"no held-out files under {args.lora_domain}/: pick another --lora-domain")
    return cut_prompts(docs, tok, args.lora_prompts, args.min_prompt_tokens, args.max_prompt_tokens, args.seed)


def train_lora(out: Path, tok: Tokenizer, train_docs: Sequence[Doc], heldout_docs: Sequence[Doc],
               args: argparse.Namespace, gen: torch.Generator) -> dict:
    """A LoRA pair for one domain: a target adapter fine-tuned on the domain's training files (plain LM loss),
    then a drafter adapter for the shipped draft distilled from the adapted target (the draft recipe's KL +
    hard loss, on domain windows and the adapted target's greedy continuations of them). --lora-minutes
    bounds the three stages together (LORA_SHARES of it each)."""
    eos_id = tok.token_to_id(EOS)
    docs = [d for d in train_docs if in_domain(d, args.lora_domain)]
    stream = encode_stream(tok, docs, eos_id)
    log.info("lora domain %s/: %d train files, %d tokens", args.lora_domain, len(docs), len(stream))
    minutes = [args.lora_minutes * share for share in LORA_SHARES]
    target_dir, draft_dir = (out / d for d in lora_dirs(args.lora_domain))

    target = with_lora(load_model(out / TARGET_DIR), args.lora_rank)
    target_run = train_loop(target, lambda: random_windows(stream, args.batch, args.seq_len + 1, gen),
                            lambda x: lm_loss(target, x), Budget(args.lora_target_steps, minutes[0]),
                            args.lora_target_lr, "target-lora", args.log_every)
    save_lora(target, target_dir, TARGET_DIR)

    # The teacher is what is served: the shipped target with the shipped (bf16) adapter, merged, in bf16.
    teacher = load_adapted(out / TARGET_DIR, target_dir, torch.bfloat16)
    gen_args = argparse.Namespace(**{**vars(args), "gen_seqs": args.lora_gen_seqs, "gen_minutes": minutes[1]})
    generated = generate_distill_set(teacher, stream, gen_args, gen)
    batches = mixed_batches(stream, generated, args, gen)
    draft = with_lora(load_model(out / DRAFT_DIR), args.lora_rank)
    draft_run = train_loop(draft, lambda: next(batches), distill_loss(teacher, draft, args.hard_weight),
                           Budget(args.lora_draft_steps, minutes[2]), args.lora_draft_lr, "draft-lora",
                           args.log_every)
    save_lora(draft, draft_dir, DRAFT_DIR)
    prompts = domain_prompts(heldout_docs, tok, args)
    write_jsonl(prompts, out / LORA_PROMPTS_FILE.format(domain=args.lora_domain))
    return {"domain": args.lora_domain, "domain_train_files": len(docs), "domain_train_tokens": len(stream),
            "target_lora_training": target_run, "generated_rows": len(generated),
            "draft_lora_training": draft_run, "adapter_bytes": {
                d.name: (d / "adapter_model.safetensors").stat().st_size for d in (target_dir, draft_dir)}}


def evaluate_lora(out: Path, tok: Tokenizer, heldout_docs: Sequence[Doc], args: argparse.Namespace) -> dict:
    """Reload the shipped pair: the domain's held-out loss with and without the target adapter, and the greedy
    acceptance of the adapted target with the base draft and with the drafter adapter, on the domain's held-out
    prompts and on as many of prompts/heldout.jsonl's from other files."""
    target_dir, draft_dir = (out / d for d in lora_dirs(args.lora_domain))
    base, draft = load_model(out / TARGET_DIR), load_model(out / DRAFT_DIR)
    adapted, adapted_draft = load_adapted(out / TARGET_DIR, target_dir), load_adapted(out / DRAFT_DIR, draft_dir)
    eos_id = tok.token_to_id(EOS)
    heldout = encode_stream(tok, [d for d in heldout_docs if in_domain(d, args.lora_domain)], eos_id)
    windows = eval_windows(heldout, args.loss_windows, args.seq_len + 1, args.seed + 3)
    report: dict = {"domain_heldout_loss": {"target": round(mean_loss(base, windows), 4),
                                            "target+adapter": round(mean_loss(adapted, windows), 4)}}
    log.info("domain held-out loss: %s", report["domain_heldout_loss"])
    on = [json.loads(line)["prompt"] for line in
          (out / LORA_PROMPTS_FILE.format(domain=args.lora_domain)).read_text().splitlines()]
    off = [r["prompt"] for r in map(json.loads, (out / PROMPTS_FILE).read_text().splitlines())
           if not r["source"].startswith(args.lora_domain + "/")]
    count = args.lora_eval_prompts
    for name, texts in (("domain", on[:count]), ("off_domain", off[:count])):
        report[name] = {
            drafter: measure_acceptance(adapted, model, tok, texts, args.eval_new_tokens, args.k)
            for drafter, model in (("base_draft", draft), ("draft+adapter", adapted_draft))
        }
        log.info("acceptance %s: %s", name, report[name])
    return report


# ---------------------------------------------------------------------- evaluation


@torch.no_grad()
def mean_loss(model: torch.nn.Module, windows: torch.Tensor, batch: int = 8) -> float:
    losses = [lm_loss(model, windows[i : i + batch]).item() * len(windows[i : i + batch])
              for i in range(0, len(windows), batch)]
    return sum(losses) / len(windows)


def eval_windows(stream: torch.Tensor, count: int, length: int, seed: int) -> torch.Tensor:
    """A fixed sample of windows (same for every model) for comparable loss numbers."""
    return random_windows(stream, count, length, torch.Generator().manual_seed(seed))


Propose = Callable[[torch.Tensor, int], torch.Tensor]  # (context [1, T], k) -> k draft tokens [1, k]
# (context [1, T], start) -> the drafter's teacher-forced guesses of context[0, start:]
TeacherForcedTop1 = Callable[[torch.Tensor, int], torch.Tensor]


@torch.no_grad()
def speculative_round(target: torch.nn.Module, propose: Propose, ctx: torch.Tensor, k: int
                      ) -> tuple[torch.Tensor, int]:
    """One greedy speculative step: the draft proposes k tokens, the target verifies them in one pass.

    Returns (tokens emitted this round, number of accepted draft tokens).  Emitted
    tokens are the accepted prefix plus the target's own next token, so the output
    is exactly the target's greedy decoding (lossless).
    """
    proposal = propose(ctx, k)
    logits = target(input_ids=torch.cat([ctx, proposal], dim=1), logits_to_keep=k + 1).logits
    verified = logits[0].argmax(-1)  # target's choice after ctx, ctx+p1, ..., ctx+p1..pk
    matches = (verified[:k] == proposal[0]).int()
    accepted = int(matches.cumprod(0).sum())
    return verified[: accepted + 1].unsqueeze(0), accepted


def sequential_propose(draft: torch.nn.Module) -> Propose:
    return lambda ctx, k: greedy_extend(draft, ctx, k)[:, ctx.size(1):]


@torch.no_grad()
def measure_acceptance(target: torch.nn.Module, draft: torch.nn.Module | None, tok: Tokenizer,
                       prompts: Sequence[str], new_tokens: int, k: int, propose: Propose | None = None,
                       top1: TeacherForcedTop1 | None = None) -> dict[str, float]:
    """Greedy speculative decoding of every prompt; `propose` defaults to k sequential draft forwards and
    `top1` to the draft model's teacher-forced argmax."""
    propose = propose or sequential_propose(draft)
    top1 = top1 or (lambda ctx, start: draft(input_ids=ctx[:, :-1]).logits[0, start - 1 :].argmax(-1))
    agree = positions = rounds = emitted_total = 0
    reached = [0] * k  # rounds whose draft position j + 1 was accepted
    for text in prompts:
        ctx = torch.tensor([tok.encode(text).ids])
        plen = ctx.size(1)
        while ctx.size(1) - plen < new_tokens:
            emitted, accepted = speculative_round(target, propose, ctx, k)
            ctx = torch.cat([ctx, emitted], dim=1)
            rounds += 1
            emitted_total += emitted.size(1)
            for j in range(accepted):
                reached[j] += 1
        # alpha: teacher-forced top-1 agreement along the target's greedy trajectory.
        cont = ctx[0, plen : plen + new_tokens]
        draft_top1 = top1(ctx[:, : plen + new_tokens], plen)
        agree += int((draft_top1 == cont).sum())
        positions += new_tokens
    alpha = agree / positions
    return {
        "prompts": len(prompts),
        "new_tokens": new_tokens,
        "k": k,
        "alpha": round(alpha, 4),
        "implied_mean_accepted_length": round((1 - alpha ** (k + 1)) / (1 - alpha), 3) if alpha < 1 else k + 1,
        "simulated_mean_accepted_length": round(emitted_total / rounds, 3),
        "accepted_per_position": [round(n / rounds, 3) for n in reached],
        "rounds": rounds,
    }


# -------------------------------------------------------------------------- prompts


def cut_prompts(heldout: Sequence[Doc], tok: Tokenizer, count: int, lo: int, hi: int, seed: int
                ) -> list[dict[str, str]]:
    """Prompts of lo..hi tokens starting at line starts of held-out files, round-robin over files."""
    rng = random.Random(seed)
    prompts: list[dict[str, str]] = []
    attempts = 0
    while len(prompts) < count and attempts < 50 * count:
        doc = heldout[attempts % len(heldout)]
        attempts += 1
        lines = doc.text.splitlines(keepends=True)
        start = rng.randrange(len(lines))
        ids = tok.encode("".join(lines[start:])).ids
        length = rng.randint(lo, hi)
        if len(ids) < length:
            continue
        text = tok.decode(ids[:length])
        if "\ufffd" in text or not text.strip():  # cut inside a multi-byte char, or blank
            continue
        prompts.append({"prompt": text, "source": doc.path})
    return prompts


def write_jsonl(rows: Sequence[dict[str, str]], path: Path) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))


# ----------------------------------------------------------------------------- main


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--out", type=Path, default=Path(__file__).resolve().parent, help="output folder")
    p.add_argument("--seed", type=int, default=1234)
    p.add_argument("--threads", type=int, default=2, help="torch intra-op threads")
    p.add_argument("--heldout-permille", type=int, default=50, help="held-out share, per mille of files")
    p.add_argument("--max-file-kib", type=int, default=256, help="skip larger files (generated data)")
    p.add_argument("--vocab-size", type=int, default=4096)
    p.add_argument("--seq-len", type=int, default=384, help="training context (prompt+64 must fit)")
    p.add_argument("--max-positions", type=int, default=1024)
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--target-steps", type=int, default=1100)
    p.add_argument("--target-minutes", type=float, default=14.0, help="wall-clock cap for the target (<= 0: none)")
    p.add_argument("--target-lr", type=float, default=2e-3)
    p.add_argument("--gen-seqs", type=int, default=1280, help="target-generated distillation rows")
    p.add_argument("--gen-batch", type=int, default=64)
    p.add_argument("--gen-minutes", type=float, default=4.0, help="wall-clock cap for generation (<= 0: none)")
    p.add_argument("--gen-mix", type=float, default=0.5, help="share of generated rows per draft batch")
    p.add_argument("--draft-steps", type=int, default=1000)
    p.add_argument("--draft-minutes", type=float, default=8.0, help="wall-clock cap for the draft (<= 0: none)")
    p.add_argument("--draft-lr", type=float, default=3e-3)
    p.add_argument("--hard-weight", type=float, default=0.5, help="weight of CE on target argmax")
    p.add_argument("--pard-steps", type=int, default=600, help="PARD fine-tuning steps of the draft")
    p.add_argument("--pard-minutes", type=float, default=10.0, help="wall-clock cap for PARD (<= 0: none)")
    p.add_argument("--pard-lr", type=float, default=1e-3)
    p.add_argument("--pard-depth", type=int, default=7, help="masks per chain: trains k up to depth + 1")
    p.add_argument("--pard-anchors", type=int, default=48, help="mask chains per training row")
    p.add_argument("--eagle3-steps", type=int, default=800, help="EAGLE-3 head training steps")
    p.add_argument("--eagle3-minutes", type=float, default=15.0, help="wall-clock cap for EAGLE-3 (<= 0: none)")
    p.add_argument("--eagle3-lr", type=float, default=3e-3)
    p.add_argument("--eagle3-depth", type=int, default=4,
                   help="training-time-test steps: step 0 over the target's features + depth - 1 chain steps")
    p.add_argument("--eagle3-decay", type=float, default=0.8, help="loss weight of chain step j: decay ** j")
    p.add_argument("--eagle3-train-lm-head", action=argparse.BooleanOptionalAction, default=False,
                   help="train the head's lm_head (else it stays the target's tied embedding, frozen)")
    p.add_argument("--p-eagle-steps", type=int, default=600, help="P-EAGLE fine-tuning steps of the EAGLE-3 head")
    p.add_argument("--p-eagle-minutes", type=float, default=10.0,
                   help="wall-clock cap for P-EAGLE (<= 0: none; keep <= 15 on 2 cores)")
    p.add_argument("--p-eagle-lr", type=float, default=1e-3)
    p.add_argument("--p-eagle-depth", type=int, default=4, help="masks per chain: trains k up to depth + 1")
    p.add_argument("--p-eagle-anchors", type=int, default=48, help="mask chains per training row")
    p.add_argument("--p-eagle-mask-weight", type=float, default=1.0,
                   help="weight of the masked positions' mean loss next to the real positions' (d_1)")
    p.add_argument("--lora-domain", default="idlelib",
                   help="the stdlib package whose files the LoRA pair is fine-tuned on (and held-out prompts from)")
    p.add_argument("--lora-rank", type=int, default=16, help="r of both adapters (alpha = 2r)")
    p.add_argument("--lora-minutes", type=float, default=8.0,
                   help="wall-clock cap of the LoRA phase's training, all three stages together (<= 0: none)")
    p.add_argument("--lora-target-steps", type=int, default=400)
    p.add_argument("--lora-target-lr", type=float, default=1e-3)
    p.add_argument("--lora-gen-seqs", type=int, default=512, help="adapted-target greedy rows for the drafter")
    p.add_argument("--lora-draft-steps", type=int, default=600)
    p.add_argument("--lora-draft-lr", type=float, default=2e-3)
    p.add_argument("--lora-prompts", type=int, default=64, help="held-out prompts of the domain written")
    p.add_argument("--lora-eval-prompts", type=int, default=48, help="prompts per side for the LoRA acceptance")
    p.add_argument("--phase", choices=("all", "pard", "pard-eval", "eagle3", "eagle3-eval", "p-eagle",
                                       "p-eagle-eval", "lora", "lora-eval"), default="all",
                   help="all: everything but EAGLE-3; pard: only the PARD draft, from the target and draft already "
                        "in --out; pard-eval: only measure the shipped PARD draft's acceptance; eagle3: only the "
                        "EAGLE-3 head for the target in --out; eagle3-eval: only measure the shipped head's "
                        "acceptance next to the sequential draft's; p-eagle: only the P-EAGLE head, fine-tuned "
                        "from the EAGLE-3 head in --out; p-eagle-eval: only measure it next to the EAGLE-3 head "
                        "and the sequential draft; lora: only the LoRA pair for --lora-domain (a target adapter "
                        "and a drafter adapter distilled from the adapted target); lora-eval: only measure it")
    p.add_argument("--loss-windows", type=int, default=48, help="windows for final loss estimates")
    p.add_argument("--num-prompts", type=int, default=160)
    p.add_argument("--min-prompt-tokens", type=int, default=20)
    p.add_argument("--max-prompt-tokens", type=int, default=300)
    p.add_argument("--eval-prompts", type=int, default=160, help="prompts used for acceptance")
    p.add_argument("--eval-new-tokens", type=int, default=64)
    p.add_argument("--k", type=int, default=4, help="draft tokens per speculative round")
    p.add_argument("--log-every", type=int, default=50)
    p.add_argument("--scale", type=float, default=1.0,
                   help="multiply all step/minute budgets (e.g. 0.05 for a smoke test)")
    return p.parse_args(argv)


def scaled(args: argparse.Namespace) -> argparse.Namespace:
    for name in ("target_steps", "draft_steps", "pard_steps", "eagle3_steps", "p_eagle_steps", "gen_seqs",
                 "lora_target_steps", "lora_draft_steps", "lora_gen_seqs"):
        setattr(args, name, max(1, round(getattr(args, name) * args.scale)))
    for name in ("target_minutes", "draft_minutes", "pard_minutes", "eagle3_minutes", "p_eagle_minutes",
                 "gen_minutes", "lora_minutes"):
        setattr(args, name, getattr(args, name) * args.scale)
    return args


def main(argv: Sequence[str] | None = None) -> None:
    argv = sys.argv[1:] if argv is None else list(argv)
    if argv[:1] == ["smollm2"]:  # the real model's drafts: models/train_smollm2.py
        from train_smollm2 import main as train_smollm2

        return train_smollm2(argv[1:])
    args = scaled(parse_args(argv))
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(message)s", datefmt="%H:%M:%S")
    torch.set_num_threads(args.threads)
    torch.manual_seed(args.seed)
    t0 = time.monotonic()
    gen = torch.Generator().manual_seed(args.seed)  # the only source of data order
    out: Path = args.out

    root = Path(sysconfig.get_paths()["stdlib"])
    train_docs, heldout_docs = split_docs(collect_docs(root, args.max_file_kib * 1024), args.heldout_permille)
    log.info("corpus %s: %d train files, %d held-out files", root, len(train_docs), len(heldout_docs))

    if args.phase == "pard-eval":
        tok = Tokenizer.from_file(str(out / TARGET_DIR / "tokenizer.json"))
        print(json.dumps({"acceptance": evaluate_pard(out, tok, args)}, indent=2))
        return
    if args.phase == "eagle3-eval":
        tok = Tokenizer.from_file(str(out / TARGET_DIR / "tokenizer.json"))
        print(json.dumps({"acceptance": evaluate_eagle3(out, tok, args)}, indent=2))
        return
    if args.phase == "eagle3":
        tok = Tokenizer.from_file(str(out / TARGET_DIR / "tokenizer.json"))
        report = train_eagle3(out, tok, encode_stream(tok, train_docs, tok.token_to_id(EOS)), args, gen)
        report["training_minutes"] = round((time.monotonic() - t0) / 60, 1)
        report["acceptance"] = evaluate_eagle3(out, tok, args)
        report["total_minutes"] = round((time.monotonic() - t0) / 60, 1)
        print(json.dumps(report, indent=2))
        return
    if args.phase == "p-eagle-eval":
        tok = Tokenizer.from_file(str(out / TARGET_DIR / "tokenizer.json"))
        print(json.dumps({"acceptance": evaluate_p_eagle(out, tok, args)}, indent=2))
        return
    if args.phase == "p-eagle":
        tok = Tokenizer.from_file(str(out / TARGET_DIR / "tokenizer.json"))
        report = train_p_eagle(out, tok, encode_stream(tok, train_docs, tok.token_to_id(EOS)), args, gen)
        report["training_minutes"] = round((time.monotonic() - t0) / 60, 1)
        report["acceptance"] = evaluate_p_eagle(out, tok, args)
        report["total_minutes"] = round((time.monotonic() - t0) / 60, 1)
        print(json.dumps(report, indent=2))
        return
    if args.phase in ("lora", "lora-eval"):
        tok = Tokenizer.from_file(str(out / TARGET_DIR / "tokenizer.json"))
        report = train_lora(out, tok, train_docs, heldout_docs, args, gen) if args.phase == "lora" else {}
        report["training_minutes"] = round((time.monotonic() - t0) / 60, 1)
        report["acceptance"] = evaluate_lora(out, tok, heldout_docs, args)
        report["total_minutes"] = round((time.monotonic() - t0) / 60, 1)
        print(json.dumps(report, indent=2))
        return
    if args.phase == "pard":
        tok = Tokenizer.from_file(str(out / TARGET_DIR / "tokenizer.json"))
        report = train_pard(out, tok, encode_stream(tok, train_docs, tok.token_to_id(EOS)), args, gen)
        report["acceptance"] = evaluate_pard(out, tok, args)
        report["total_minutes"] = round((time.monotonic() - t0) / 60, 1)
        print(json.dumps(report, indent=2))
        return

    tok = train_tokenizer([d.text for d in train_docs], args.vocab_size)
    eos_id = tok.token_to_id(EOS)
    train_stream = encode_stream(tok, train_docs, eos_id)
    heldout_stream = encode_stream(tok, heldout_docs, eos_id)
    chars = sum(len(d.text) for d in train_docs)
    log.info("tokenizer: vocab %d; train %d tokens (%.2f chars/token), held-out %d tokens",
             tok.get_vocab_size(), len(train_stream), chars / len(train_stream), len(heldout_stream))
    for folder in (TARGET_DIR, DRAFT_DIR):
        save_tokenizer(tok, out / folder, args.max_positions)

    def next_batch() -> torch.Tensor:
        return random_windows(train_stream, args.batch, args.seq_len + 1, gen)

    target = build_model(TARGET_ARCH, tok.get_vocab_size(), eos_id, args.max_positions)
    log.info("target: %d parameters", n_params(target))
    target_run = train_loop(target, next_batch, lambda x: lm_loss(target, x),
                            Budget(args.target_steps, args.target_minutes), args.target_lr, "target",
                            args.log_every)
    save_model(target, out / TARGET_DIR, eos_id)
    # The teacher is the shipped bf16 target, not the fp32 master copy; pure bf16 is
    # also ~1.5x faster than fp32 here for both its forward passes and generation.
    teacher = load_model(out / TARGET_DIR, torch.bfloat16)

    generated = generate_distill_set(teacher, train_stream, args, gen)
    batches = mixed_batches(train_stream, generated, args, gen)
    draft = build_model(DRAFT_ARCH, tok.get_vocab_size(), eos_id, args.max_positions)
    log.info("draft: %d parameters", n_params(draft))
    draft_run = train_loop(draft, lambda: next(batches), distill_loss(teacher, draft, args.hard_weight),
                           Budget(args.draft_steps, args.draft_minutes), args.draft_lr, "draft",
                           args.log_every)
    save_model(draft, out / DRAFT_DIR, eos_id)

    prompts = cut_prompts(heldout_docs, tok, args.num_prompts, args.min_prompt_tokens,
                          args.max_prompt_tokens, args.seed)
    write_jsonl(prompts, out / PROMPTS_FILE)
    log.info("wrote %d prompts to %s", len(prompts), out / PROMPTS_FILE)

    pard = train_pard(out, tok, train_stream, args, gen)
    report = evaluate(out, tok, train_stream, heldout_stream, prompts, args)
    report["pard"] = {**pard, "acceptance": evaluate_pard(out, tok, args)}
    report["target_training"], report["draft_training"] = target_run, draft_run
    report["generated_rows"] = len(generated)
    report["total_minutes"] = round((time.monotonic() - t0) / 60, 1)
    report["args"] = {k: str(v) for k, v in vars(args).items()}
    print(json.dumps(report, indent=2))


def evaluate(out: Path, tok: Tokenizer, train_stream: torch.Tensor, heldout_stream: torch.Tensor,
             prompts: Sequence[dict[str, str]], args: argparse.Namespace) -> dict:
    """Reload the shipped folders and measure losses and greedy acceptance."""
    target, draft = load_model(out / TARGET_DIR), load_model(out / DRAFT_DIR)
    assert Tokenizer.from_file(str(out / TARGET_DIR / "tokenizer.json")).get_vocab_size() == tok.get_vocab_size()
    train_w = eval_windows(train_stream, args.loss_windows, args.seq_len + 1, args.seed + 1)
    heldout_w = eval_windows(heldout_stream, args.loss_windows, args.seq_len + 1, args.seed + 2)
    report: dict = {"python": sysconfig.get_python_version(), "arch": {}}
    for name, model, arch in (("target", target, TARGET_ARCH), ("draft", draft, DRAFT_ARCH)):
        report["arch"][name] = asdict(arch)
        report[name] = {
            "parameters": n_params(model),
            "train_loss": round(mean_loss(model, train_w), 4),
            "heldout_loss": round(mean_loss(model, heldout_w), 4),
            "weights_bytes": (out / (TARGET_DIR if name == "target" else DRAFT_DIR) / "model.safetensors")
            .stat().st_size,
        }
        log.info("%s: %s", name, report[name])
    texts = [p["prompt"] for p in prompts[: args.eval_prompts]]
    report["acceptance"] = measure_acceptance(target, draft, tok, texts, args.eval_new_tokens, args.k)
    log.info("acceptance: %s", report["acceptance"])
    return report


def evaluate_pard(out: Path, tok: Tokenizer, args: argparse.Namespace) -> dict:
    """Greedy acceptance of the shipped draft proposing k tokens in k forwards, and of its PARD version in one."""
    target, draft, pard = load_model(out / TARGET_DIR), load_model(out / DRAFT_DIR), load_model(out / PARD_DIR)
    mask_id = tok.token_to_id(PARD_MASK)
    rows = [json.loads(line) for line in (out / PROMPTS_FILE).read_text().splitlines()]
    texts = [r["prompt"] for r in rows[: args.eval_prompts]]
    report = {}
    for k in sorted({2, args.k, args.pard_depth + 1}):
        report[f"k={k}"] = {
            "sequential_draft": measure_acceptance(target, draft, tok, texts, args.eval_new_tokens, k),
            "pard": measure_acceptance(target, pard, tok, texts, args.eval_new_tokens, k,
                                       lambda ctx, k: pard_propose(pard, ctx, k, mask_id)),
        }
        log.info("acceptance k=%d: %s", k, report[f"k={k}"])
    return report


def evaluate_eagle3(out: Path, tok: Tokenizer, args: argparse.Namespace) -> dict:
    """Greedy acceptance at k of the shipped EAGLE-3 head and of the sequential draft on the same prompts."""
    target, draft = load_model(out / TARGET_DIR), load_model(out / DRAFT_DIR)
    head = load_eagle3(out / EAGLE3_DIR, target)
    rows = [json.loads(line) for line in (out / PROMPTS_FILE).read_text().splitlines()]
    texts = [r["prompt"] for r in rows[: args.eval_prompts]]
    report = {
        "sequential_draft": measure_acceptance(target, draft, tok, texts, args.eval_new_tokens, args.k),
        "eagle3": measure_acceptance(target, None, tok, texts, args.eval_new_tokens, args.k,
                                     lambda ctx, k: eagle3_propose(target, head, ctx, k),
                                     lambda ctx, start: eagle3_top1(target, head, ctx, start)),
    }
    log.info("acceptance k=%d: %s", args.k, report)
    return {f"k={args.k}": report}


def evaluate_p_eagle(out: Path, tok: Tokenizer, args: argparse.Namespace) -> dict:
    """Greedy acceptance at k on the same prompts of the sequential draft (k forwards), the EAGLE-3 head
    (k head steps) and the P-EAGLE head (one head forward)."""
    target, draft = load_model(out / TARGET_DIR), load_model(out / DRAFT_DIR)
    eagle = load_eagle3(out / EAGLE3_DIR, target)
    parallel, mask_id = load_p_eagle(out / P_EAGLE_DIR, target)
    rows = [json.loads(line) for line in (out / PROMPTS_FILE).read_text().splitlines()]
    texts = [r["prompt"] for r in rows[: args.eval_prompts]]
    report = {
        "sequential_draft": measure_acceptance(target, draft, tok, texts, args.eval_new_tokens, args.k),
        "eagle3": measure_acceptance(target, None, tok, texts, args.eval_new_tokens, args.k,
                                     lambda ctx, k: eagle3_propose(target, eagle, ctx, k),
                                     lambda ctx, start: eagle3_top1(target, eagle, ctx, start)),
        "p_eagle": measure_acceptance(target, None, tok, texts, args.eval_new_tokens, args.k,
                                      lambda ctx, k: p_eagle_propose(target, parallel, ctx, k, mask_id),
                                      lambda ctx, start: eagle3_top1(target, parallel, ctx, start)),
    }
    log.info("acceptance k=%d: %s", args.k, report)
    return {f"k={args.k}": report}


if __name__ == "__main__":
    main()
