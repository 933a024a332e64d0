"""A decode step's forward as one C call (model/kernels/cpu_stack.py, model/kernels/decode_stack.c) against the
same model's layers run one by one."""

from __future__ import annotations

import random

import pytest
import torch

from minedraft.config import BUNDLED_DRAFT, EngineConfig, SpeculativeConfig
from minedraft.engine.runners import draft_runner
from minedraft.model.kernels.cpu_stack import MAX_ROWS, DecodeStack
from minedraft.model.runner import ModelRunner, SeqInput

from tiny_models import make_tiny_checkpoint


def _pair(path) -> tuple[ModelRunner, ModelRunner]:
    """Two runners of one checkpoint with the C fused kernels: with the one-call stack and without."""
    with_stack, without = (ModelRunner(path, max_seq_len=256, num_slots=8) for _ in range(2))
    without.model.model.decode_stack = None
    return with_stack, without


def _run_both(runners: tuple[ModelRunner, ModelRunner], step: list[SeqInput]) -> tuple[torch.Tensor, torch.Tensor]:
    return runners[0].forward(step), runners[1].forward(step)


# llama (head_dim 16), qwen2 (qkv bias), qwen3 (q/k norm, tied embeddings), and a ragged shape: 3 heads of 16 over
# one kv head, so that the QKV, output and LM head widths (80, 48, 330) end in partial tiles of the GEMM.
SHAPES = {
    "llama": {"arch": "llama"},
    "qwen2": {"arch": "qwen2"},
    "qwen3": {"arch": "qwen3"},
    "ragged": {"arch": "llama", "hidden_size": 48, "num_heads": 3, "num_kv_heads": 1, "vocab_size": 330},
}


@pytest.mark.parametrize("shape", SHAPES)
def test_the_stack_matches_the_layers_one_by_one(tmp_path, shape: str) -> None:
    """Prompts of several lengths in one step, then decode steps, verification windows and ragged windows of
    several sequences, all through the one call, the caches it writes read by the next steps: logits within
    float32 noise."""
    settings = {"hidden_size": 64, "num_layers": 2, "seed": 3, **SHAPES[shape]}
    runners = _pair(make_tiny_checkpoint(tmp_path / shape, **settings))
    assert runners[0].decode_stack and runners[0].fused_kernels == "cpu"
    vocab = settings.get("vocab_size", 320)
    rng = random.Random(0)
    prompts = [[rng.randrange(vocab) for _ in range(n)] for n in (3, 17, 40, 90)]
    for runner in runners:
        for _ in prompts:
            runner.allocate_slot()
    prefill = [SeqInput(i, p, 0, num_logits=len(p)) for i, p in enumerate(prompts)]
    assert DecodeStack.takes([len(p) for p in prompts])  # 150 rows, one prompt of 90
    with_stack, without = _run_both(runners, prefill)
    torch.testing.assert_close(with_stack, without, atol=1e-4, rtol=1e-4)
    lengths = [len(p) for p in prompts]
    # Rows 4, 20, 13, 5, 15 and 6: every row block of the GEMM, one pass (up to 6 rows) and two halves (7, 8).
    for window in ([1, 1, 1, 1], [5, 5, 5, 5], [1, 3, 2, 7], [1, 0, 4, 0], [6, 7, 1, 1], [0, 6, 0, 0]):
        step = [SeqInput(i, [rng.randrange(vocab) for _ in range(n)], lengths[i], num_logits=n)
                for i, n in enumerate(window) if n]  # fmt: skip
        with_stack, without = _run_both(runners, step)
        torch.testing.assert_close(with_stack, without, atol=1e-4, rtol=1e-4)
        for seq in step:
            lengths[seq.slot] += len(seq.token_ids)


def test_a_rows_logits_are_the_same_alone_and_in_any_batch(tmp_path) -> None:
    """Every output is one sum in a fixed order, whoever shares the call (and however many threads split it):
    a sequence's draft does not depend on the batch around it."""
    path = make_tiny_checkpoint(tmp_path / "m", arch="qwen3", hidden_size=64, num_layers=2, seed=1)
    alone, batched = (ModelRunner(path, max_seq_len=256, num_slots=8) for _ in range(2))
    rng = random.Random(1)
    prompts = [[rng.randrange(320) for _ in range(20 + 7 * i)] for i in range(8)]
    for runner in (alone, batched):
        for prompt in prompts:
            runner.forward([SeqInput(runner.allocate_slot(), prompt, 0)])
    window = [5, 9, 2, 6]
    mine = alone.forward([SeqInput(0, window, len(prompts[0]), num_logits=4)])
    # 8 sequences of 8 tokens: MAX_ROWS rows, enough multiply-adds for the GEMMs to split between threads
    others = [SeqInput(i, [rng.randrange(320) for _ in range(8)], len(p), num_logits=8)
              for i, p in enumerate(prompts) if i]  # fmt: skip
    assert sum(len(s.token_ids) for s in others) + len(window) <= MAX_ROWS
    together = batched.forward([*others[:3], SeqInput(0, window, len(prompts[0]), num_logits=4), *others[3:]])
    assert torch.equal(together[24:28], mine)


@pytest.mark.parametrize("shape", ["qwen2", "ragged"])
def test_bfloat16_weights_are_held_as_bfloat16_with_the_same_logits(tmp_path, shape: str) -> None:
    """A bfloat16 checkpoint run in float32: the stack holds its weights as bfloat16 (half the bytes) and widens
    them to the very floats a float32 copy holds, so every logit is the same bit for bit, in the full tiles and
    the ragged tails (and biases) alike. A float32 checkpoint keeps float32 copies."""
    settings = {"hidden_size": 64, "num_layers": 2, "seed": 5, **SHAPES[shape]}
    path = make_tiny_checkpoint(tmp_path / shape, dtype=torch.bfloat16, **settings)
    narrow, wide = (ModelRunner(path, max_seq_len=256, num_slots=4) for _ in range(2))
    assert narrow.decode_stack and narrow.model.model.decode_stack.bf16
    wide.model.model.decode_stack = DecodeStack(wide.model, bf16=False)
    vocab = settings.get("vocab_size", 320)
    rng = random.Random(2)
    prompts = [[rng.randrange(vocab) for _ in range(n)] for n in (9, 30)]
    for runner in (narrow, wide):
        for _ in prompts:
            runner.allocate_slot()
        runner.forward([SeqInput(i, p, 0) for i, p in enumerate(prompts)])
    for window in ([1, 1], [5, 3], [8, 1]):
        step = [SeqInput(i, [rng.randrange(vocab) for _ in range(n)], len(prompts[i]), num_logits=n)
                for i, n in enumerate(window)]  # fmt: skip
        assert torch.equal(narrow.forward(step), wide.forward(step))
        prompts = [p + s.token_ids for p, s in zip(prompts, step)]
    float32 = ModelRunner(make_tiny_checkpoint(tmp_path / "f32", **settings), max_seq_len=64, num_slots=1)
    assert not float32.model.model.decode_stack.bf16
    with pytest.raises(ValueError, match="not all bfloat16 values"):
        DecodeStack(float32.model, bf16=True)


def test_steps_the_call_does_not_take_run_the_layers(tmp_path) -> None:
    """More rows than MAX_ROWS (a prompt, or windows of many sequences): the layers one by one, the same logits as
    a runner without the stack bit for bit."""
    runners = _pair(make_tiny_checkpoint(tmp_path / "m", arch="llama", hidden_size=64, num_layers=2, seed=2))
    for runner in runners:
        for _ in range(3):
            runner.allocate_slot()
    assert not DecodeStack.takes([MAX_ROWS - 30, 31])
    with_stack, without = _run_both(runners, [SeqInput(0, list(range(3, MAX_ROWS - 27)), 0),
                                              SeqInput(2, [4] * 31, 0)])  # fmt: skip
    assert torch.equal(with_stack, without)
    windows = [(0, 80, 22), (1, 0, MAX_ROWS - 43), (2, 20, 22)]  # (slot, start, tokens): one more row than MAX_ROWS
    step = [SeqInput(slot, [7] * n, start, num_logits=n) for slot, start, n in windows]
    with_stack, without = _run_both(runners, step)
    assert torch.equal(with_stack, without)


def test_the_stack_says_why_it_does_not_take_a_model(tmp_path) -> None:
    moe = ModelRunner(make_tiny_checkpoint(tmp_path / "moe", arch="qwen3_moe", hidden_size=64), max_seq_len=64,
                      num_slots=1)  # fmt: skip
    assert moe.fused_kernels == "cpu" and not moe.decode_stack
    assert DecodeStack.build(moe.model) == (None, "mixture-of-experts layers")
    bf16 = ModelRunner(make_tiny_checkpoint(tmp_path / "bf16", arch="llama"), max_seq_len=64, num_slots=1,
                       dtype="bfloat16", fused_kernels="off")  # fmt: skip
    assert not bf16.decode_stack
    assert "a float32 model on CPU, not torch.bfloat16" in DecodeStack.build(bf16.model)[1]


def test_the_stack_runs_with_the_c_fused_kernels_only() -> None:
    """The default mode's draft and target run it; the strict mode's target keeps torch's ops (its GEMMs of fixed
    shapes are what makes a prompt's tokens and a decode step's agree bit for bit), its draft runs it (whatever
    the draft proposes, the output is exactly the target's)."""
    for strict in (False, True):
        config = EngineConfig(speculative_config=SpeculativeConfig(num_speculative_tokens=4), device="cpu",
                              batch_invariant=strict)  # fmt: skip
        draft = draft_runner(config, num_slots=2, max_len=128, device="cpu")
        assert draft.config.num_hidden_layers == 2 and draft.decode_stack
        target = ModelRunner(config.target_path, max_seq_len=128, num_slots=2, batch_invariant=strict)
        assert target.decode_stack is not strict
    assert not ModelRunner(BUNDLED_DRAFT, max_seq_len=64, num_slots=1, fused_kernels="off").decode_stack


def test_greedy_drafting_in_one_call_is_the_forward_and_argmax_loop(tmp_path) -> None:
    """`ModelRunner.draft_greedy`: windows of different lengths across block boundaries, as forwards of one token
    and argmaxes give them (the same tokens, the same cache for the next step) with softmax's top probability."""
    path = make_tiny_checkpoint(tmp_path / "m", arch="qwen3", hidden_size=64, num_layers=2, seed=4)
    one_call, loop = (ModelRunner(path, max_seq_len=256, num_slots=4, block_size=16) for _ in range(2))
    rng = random.Random(4)
    prompts = [[rng.randrange(320) for _ in range(n)] for n in (12, 30, 47)]
    for runner in (one_call, loop):
        for prompt in prompts:
            runner.forward([SeqInput(runner.allocate_slot(), prompt, 0)])
    pending = [[5], [9, 11], [3]]  # a sequence may write more than its last token (a rejected draft's tail)
    steps = [4, 1, 7]
    starts = [len(p) for p in prompts]
    starts[1] -= 1  # it rewrites its last prompt token
    tokens, confidence = one_call.draft_greedy([SeqInput(i, t, s) for i, (t, s) in enumerate(zip(pending, starts))],
                                               steps)  # fmt: skip
    expected = [[] for _ in steps]
    live = list(range(3))
    inputs = [SeqInput(i, t, s) for i, (t, s) in enumerate(zip(pending, starts))]
    while live:
        logits = loop.forward([inputs[i] for i in live])
        for row, i in enumerate(live):
            expected[i].append(int(logits[row].argmax()))
            assert confidence[i][len(expected[i]) - 1] == pytest.approx(float(logits[row].softmax(-1).max()), rel=1e-5)
            end = inputs[i].start_pos + len(inputs[i].token_ids)
            inputs[i] = SeqInput(i, [expected[i][-1]], end)
        live = [i for i in live if len(expected[i]) < steps[i]]
    assert tokens == expected
    for i, (start, n) in enumerate(zip(starts, steps)):  # the last draft token is not written
        assert one_call.kv_cache.lengths[i] == start + len(pending[i]) + n - 1
    step = [SeqInput(i, [t[-1]], one_call.kv_cache.lengths[i]) for i, t in enumerate(tokens)]
    assert torch.equal(one_call.forward(step), loop.forward(step))
    with pytest.raises(ValueError, match="at least 1"):
        one_call.draft_greedy([SeqInput(0, [1], one_call.kv_cache.lengths[0])], [0])
