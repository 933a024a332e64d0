"""EAGLE heads of both kinds (model/eagle.py) and the drafter that runs them (engine/eagle_drafter.py).

The heads' numerics against references written here from the checkpoint formats' definitions (EAGLE-3: both
layouts, draft vocabularies; EAGLE-1: with and without fc.bias, own embedding and LM head, HASS norms,
safetensors and pytorch_model.bin), the target's features against transformers' hidden states, and every
decoding mode lossless with a random head (it proposes, the target decides).
"""

from __future__ import annotations

import json
import math

import pytest
import torch
from safetensors.torch import load_file

from minedraft import LLM, SamplingParams
from minedraft.config import BUNDLED_TARGET, EngineConfig
from minedraft.model.checkpoint import CheckpointError
from minedraft.model.runner import ModelRunner, SeqInput

from tiny_models import make_eagle3_head, make_eagle_head, make_tiny_checkpoint, read_head_weights

VOCAB, HIDDEN = 320, 64


def _rms(x: torch.Tensor, weight: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * weight


def _rope(x: torch.Tensor, positions: torch.Tensor, theta: float = 10000.0) -> torch.Tensor:
    """Rotate-half rotary embedding of x [tokens, heads, dim] at `positions`."""
    dim = x.shape[-1]
    freqs = positions[:, None].double() * theta ** (-torch.arange(0, dim, 2).double() / dim)
    cos, sin = torch.cat((freqs.cos(), freqs.cos()), -1)[:, None], torch.cat((freqs.sin(), freqs.sin()), -1)[:, None]
    rotated = torch.cat((-x[..., dim // 2 :], x[..., : dim // 2]), -1)
    return (x.double() * cos + rotated.double() * sin).to(x.dtype)


def reference_head(weights: dict[str, torch.Tensor], config: dict, embedding: torch.Tensor, tokens: list[int],
                   hidden: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:  # fmt: skip
    """Logits over the draft vocabulary and the layer's outputs of positions 0 .. n - 1, from the format's
    definition: token t at position p with hidden input h; attention over positions <= p."""
    w = {k.replace("layers.0.", "midlayer."): v.float() for k, v in weights.items()}
    heads, kv_heads, dim = config["num_attention_heads"], config["num_key_value_heads"], config["head_dim"]
    x = torch.cat((_rms(embedding[tokens], w["midlayer.input_layernorm.weight"]),
                   _rms(hidden, w["midlayer.hidden_norm.weight"])), -1)  # fmt: skip
    h = hidden + _attention(x, w, "midlayer.self_attn", heads, kv_heads, dim)
    m = _rms(h, w["midlayer.post_attention_layernorm.weight"])
    gate, up = m @ w["midlayer.mlp.gate_proj.weight"].T, m @ w["midlayer.mlp.up_proj.weight"].T
    out = h + (torch.nn.functional.silu(gate) * up) @ w["midlayer.mlp.down_proj.weight"].T
    return _rms(out, w["norm.weight"]) @ w["lm_head.weight"].T, out


def _attention(x: torch.Tensor, w: dict[str, torch.Tensor], prefix: str, heads: int, kv_heads: int,
               dim: int) -> torch.Tensor:  # fmt: skip
    """Causal self-attention of a Llama layer over positions 0 .. n - 1 of x [n, in]."""
    n = len(x)
    q = (x @ w[f"{prefix}.q_proj.weight"].T).view(n, heads, dim)
    k = (x @ w[f"{prefix}.k_proj.weight"].T).view(n, kv_heads, dim)
    v = (x @ w[f"{prefix}.v_proj.weight"].T).view(n, kv_heads, dim)
    positions = torch.arange(n)
    q, k = _rope(q, positions), _rope(k, positions)
    k, v = k.repeat_interleave(heads // kv_heads, 1), v.repeat_interleave(heads // kv_heads, 1)
    scores = torch.einsum("qhd,khd->hqk", q, k) / math.sqrt(dim)
    scores = scores.masked_fill(torch.ones(n, n, dtype=torch.bool).triu(1), float("-inf"))
    attn = torch.einsum("hqk,khd->qhd", scores.softmax(-1), v).reshape(n, heads * dim)
    return attn @ w[f"{prefix}.o_proj.weight"].T


def reference_eagle1(weights: dict[str, torch.Tensor], config: dict, embedding: torch.Tensor, lm_head: torch.Tensor,
                     tokens: list[int], hidden: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:  # fmt: skip
    """EAGLE-1, from the format's definition: x = fc(concat(embed(t), h)) (+ bias), Llama decoder layers
    whose first has no input norm, no final norm, logits = LM head(output). HASS: RMSNorm on both inputs."""
    w = {k: v.float() for k, v in weights.items()}
    heads, kv_heads, dim = config["num_attention_heads"], config["num_key_value_heads"], config["head_dim"]
    embeds = embedding[tokens]
    if config.get("add_para_norm"):
        embeds = _rms(embeds, w["embedding_layernorm.weight"])
        hidden = _rms(hidden, w["hidden_states_layernorm.weight"])
    x = torch.cat((embeds, hidden), -1) @ w["fc.weight"].T + w.get("fc.bias", 0)
    for i in range(config["num_hidden_layers"]):
        layer = f"layers.{i}"
        normed = x if i == 0 else _rms(x, w[f"{layer}.input_layernorm.weight"])
        x = x + _attention(normed, w, f"{layer}.self_attn", heads, kv_heads, dim)
        m = _rms(x, w[f"{layer}.post_attention_layernorm.weight"])
        gate, up = m @ w[f"{layer}.mlp.gate_proj.weight"].T, m @ w[f"{layer}.mlp.up_proj.weight"].T
        x = x + (torch.nn.functional.silu(gate) * up) @ w[f"{layer}.mlp.down_proj.weight"].T
    return x @ lm_head.T, x


@pytest.fixture(scope="module")
def target(tmp_path_factory) -> str:
    return str(make_tiny_checkpoint(tmp_path_factory.mktemp("target"), "qwen3", vocab_size=VOCAB,
                                    hidden_size=HIDDEN, num_layers=4, seed=3))  # fmt: skip


def _head_runner(head, target) -> ModelRunner:
    return ModelRunner(head, max_seq_len=128, num_slots=2, target_path=target)


@pytest.mark.parametrize("layout", ["eagle3", "speculators"])
@pytest.mark.parametrize("with_embedding", [False, True])
def test_head_matches_the_reference_written_from_the_format(tmp_path, target, layout, with_embedding) -> None:
    head = make_eagle3_head(tmp_path / "head", hidden_size=HIDDEN, vocab_size=VOCAB, head_dim=16, layout=layout,
                            with_embedding=with_embedding, seed=1)  # fmt: skip
    weights = load_file(str(head / "model.safetensors"))
    config = json.loads((head / "config.json").read_text())
    config = config.get("transformer_layer_config", config)
    shared = load_file(f"{target}/model.safetensors")["model.embed_tokens.weight"]
    embedding = weights.get("embed_tokens.weight", shared)
    runner = _head_runner(head, target)
    tokens = [(7 * i + 3) % VOCAB for i in range(11)]
    hidden = torch.randn(11, HIDDEN, generator=torch.Generator().manual_seed(0))
    expected_logits, expected_out = reference_head(weights, config, embedding.float(), tokens, hidden)

    slot = runner.allocate_slot()
    logits = runner.forward([SeqInput(slot, tokens[:8], 0, num_logits=8, hidden=hidden[:8])])
    torch.testing.assert_close(logits, expected_logits[:8], atol=2e-4, rtol=2e-4)
    torch.testing.assert_close(runner.head_hidden, expected_out[:8], atol=2e-4, rtol=2e-4)
    # The rest one position at a time over the cache, as drafting steps run.
    for p in range(8, 11):
        step = runner.forward([SeqInput(slot, [tokens[p]], p, hidden=hidden[p : p + 1])])
        torch.testing.assert_close(step, expected_logits[p : p + 1], atol=2e-4, rtol=2e-4)


@pytest.fixture(scope="module")
def llama_target(tmp_path_factory) -> str:
    """A target with its own LM head (untied), where the tied qwen3 one's LM head is its embedding."""
    return str(make_tiny_checkpoint(tmp_path_factory.mktemp("llama"), "llama", vocab_size=VOCAB, hidden_size=HIDDEN,
                                    num_layers=2, seed=7))  # fmt: skip


EAGLE1_HEADS = {
    "fc-bias": {},
    "no-bias+bin": {"fc_bias": False, "file_format": "bin"},
    "own-embedding+lm-head+2-layers": {"with_embedding": True, "with_lm_head": True, "num_layers": 2},
    "hass+bin": {"para_norm": True, "file_format": "bin", "with_lm_head": True},
}


@pytest.mark.parametrize("options", EAGLE1_HEADS.values(), ids=EAGLE1_HEADS.keys())
@pytest.mark.parametrize("target_name", ["target", "llama_target"], ids=["tied-target", "untied-target"])
def test_eagle1_head_matches_the_reference_written_from_the_format(tmp_path, request, options, target_name) -> None:
    target = request.getfixturevalue(target_name)
    head = make_eagle_head(tmp_path / "head", hidden_size=HIDDEN, vocab_size=VOCAB, head_dim=16, seed=1, **options)
    weights = read_head_weights(head)
    config = json.loads((head / "config.json").read_text())
    own = load_file(f"{target}/model.safetensors")
    embedding = weights.get("embed_tokens.weight", own["model.embed_tokens.weight"]).float()
    lm_head = weights.get("lm_head.weight", own.get("lm_head.weight", own["model.embed_tokens.weight"])).float()
    runner = _head_runner(head, target)
    assert runner.head_kind == "eagle"
    tokens = [(7 * i + 3) % VOCAB for i in range(11)]
    hidden = torch.randn(11, HIDDEN, generator=torch.Generator().manual_seed(0))
    expected_logits, expected_out = reference_eagle1(weights, config, embedding, lm_head, tokens, hidden)

    slot = runner.allocate_slot()
    logits = runner.forward([SeqInput(slot, tokens[:8], 0, num_logits=8, hidden=hidden[:8])])
    torch.testing.assert_close(logits, expected_logits[:8], atol=2e-4, rtol=2e-4)
    torch.testing.assert_close(runner.head_hidden, expected_out[:8], atol=2e-4, rtol=2e-4)
    for p in range(8, 11):  # one position at a time over the cache, as drafting steps run
        step = runner.forward([SeqInput(slot, [tokens[p]], p, hidden=hidden[p : p + 1])])
        torch.testing.assert_close(step, expected_logits[p : p + 1], atol=2e-4, rtol=2e-4)


def test_a_draft_vocabulary_maps_to_target_ids_through_d2t(tmp_path, target) -> None:
    head = make_eagle3_head(tmp_path / "head", hidden_size=HIDDEN, vocab_size=VOCAB, head_dim=16,
                            draft_vocab_size=VOCAB // 2, seed=2)  # fmt: skip
    weights = load_file(str(head / "model.safetensors"))
    config = json.loads((head / "config.json").read_text())
    embedding = load_file(f"{target}/model.safetensors")["model.embed_tokens.weight"].float()
    tokens, hidden = [5, 9, 11], torch.randn(3, HIDDEN, generator=torch.Generator().manual_seed(1))
    draft_logits, _ = reference_head(weights, config, embedding, tokens, hidden)
    runner = _head_runner(head, target)
    logits = runner.forward([SeqInput(runner.allocate_slot(), tokens, 0, num_logits=3, hidden=hidden)])
    assert logits.shape == (3, VOCAB)
    torch.testing.assert_close(logits[:, ::2], draft_logits, atol=2e-4, rtol=2e-4)  # draft id i is target id 2 i
    assert torch.isinf(logits[:, 1::2]).all(), "target ids outside the draft vocabulary get no probability"


@pytest.mark.parametrize("layers", [(1, 3, 2), (4,)], ids=["eagle3-layer-inputs", "eagle1-final-normed"])
def test_target_features_are_transformers_hidden_states(target, layers) -> None:
    """aux_hidden_layers against transformers' output_hidden_states: element i < 4 the input of layer i (what
    an EAGLE-3 head reads), element 4 of the 4-layer target the last state after the final norm (EAGLE-1)."""
    transformers = pytest.importorskip("transformers")
    tokens = [(11 * i + 2) % VOCAB for i in range(9)]
    runner = ModelRunner(target, max_seq_len=64, aux_hidden_layers=layers)
    runner.forward([SeqInput(runner.allocate_slot(), tokens, 0)])
    reference = transformers.AutoModelForCausalLM.from_pretrained(target, torch_dtype=torch.float32)
    with torch.no_grad():
        states = reference(torch.tensor([tokens]), output_hidden_states=True).hidden_states
    assert len(states) == 5
    expected = torch.cat([states[i][0] for i in layers], -1)
    torch.testing.assert_close(runner.aux_hidden, expected, atol=1e-4, rtol=1e-4)
    assert runner.feature_width == len(layers) * HIDDEN


def test_what_an_eagle3_head_cannot_be_used_with_is_refused(tmp_path, target) -> None:
    head = make_eagle3_head(tmp_path / "head", hidden_size=HIDDEN, vocab_size=VOCAB, head_dim=16)
    with pytest.raises(ValueError, match="is an EAGLE-3 head: use it with method eagle3"):
        ModelRunner(head, max_seq_len=64)
    with pytest.raises(ValueError, match="method eagle3 needs an EAGLE-3 head"):
        LLM(model=target, speculative_config={"method": "eagle3", "model": target})
    with pytest.raises(ValueError, match=r"\[5\] outside the target's hidden states 0 .. 4"):
        ModelRunner(target, max_seq_len=64, aux_hidden_layers=(1, 2, 5))
    broken = make_eagle3_head(tmp_path / "broken", hidden_size=HIDDEN, vocab_size=VOCAB, head_dim=16,
                              draft_vocab_size=VOCAB // 2)  # fmt: skip
    weights = load_file(str(broken / "model.safetensors"))
    weights["d2t"] = torch.full((VOCAB // 2,), VOCAB)  # maps past the target's vocabulary
    from safetensors.torch import save_file

    save_file(weights, str(broken / "model.safetensors"))
    with pytest.raises(CheckpointError, match="d2t maps draft ids outside the target vocabulary"):
        _head_runner(broken, target)
    with pytest.raises(ValueError, match="needs a P-EAGLE head: .* has no mask_hidden tensor"):
        LLM(model=target, speculative_config={"method": "eagle3", "model": str(head), "parallel_drafting": True})


def test_what_an_eagle1_head_cannot_be_used_with_is_refused(tmp_path, target) -> None:
    head = make_eagle_head(tmp_path / "head", hidden_size=HIDDEN, vocab_size=VOCAB, head_dim=16)
    eagle3 = make_eagle3_head(tmp_path / "eagle3", hidden_size=HIDDEN, vocab_size=VOCAB, head_dim=16)
    with pytest.raises(ValueError, match="is an EAGLE-1 head: use it with method eagle"):
        ModelRunner(head, max_seq_len=64)
    with pytest.raises(ValueError, match="is an EAGLE-1 head: use it with method eagle"):
        LLM(model=target, speculative_config={"model": str(head)})  # as a draft model
    not_a_head = "method eagle needs an EAGLE-1 head: .* is a Qwen3ForCausalLM checkpoint without that layout .Llama"
    with pytest.raises(ValueError, match=not_a_head):
        LLM(model=target, speculative_config={"method": "eagle", "model": target})
    with pytest.raises(ValueError, match="needs an EAGLE-1 head: .* is an EAGLE-3 head .use method eagle3"):
        LLM(model=target, speculative_config={"method": "eagle", "model": str(eagle3)})
    with pytest.raises(ValueError, match="eagle3 needs an EAGLE-3 head: .* is an EAGLE-1 head .use method eagle"):
        LLM(model=target, speculative_config={"method": "eagle3", "model": str(head)})
    with pytest.raises(ValueError, match="parallel_drafting .P-EAGLE. needs an EAGLE-3 head"):
        EngineConfig(speculative_config={"method": "eagle", "model": str(head), "parallel_drafting": True})
    with pytest.raises(ValueError, match=r"method eagle needs model: .* \(none is bundled\)"):
        EngineConfig(speculative_config={"method": "eagle"})
    # A weight the format does not have is refused by name, never dropped.
    weights = read_head_weights(head)
    weights["layers.0.input_layernorm.weight"] = torch.ones(HIDDEN)
    from safetensors.torch import save_file

    save_file(weights, str(head / "model.safetensors"))
    with pytest.raises(CheckpointError, match="tensors the format does not use: layers.0.input_layernorm.weight"):
        _head_runner(head, target)


@pytest.fixture(scope="module")
def random_head(tmp_path_factory) -> str:
    """A random P-EAGLE-capable head for the bundled target (hidden 256, 4 / 2 heads of 64): it proposes
    nonsense, token by token or (with parallel_drafting) in one pass."""
    return str(make_eagle3_head(tmp_path_factory.mktemp("head"), hidden_size=256, vocab_size=4096, head_dim=64,
                                aux_layers=[1, 3, 5], mask_token_id=188, seed=4))  # fmt: skip


@pytest.fixture(scope="module")
def random_eagle1_head(tmp_path_factory) -> str:
    """A random EAGLE-1 head for the bundled target, with fc.bias, the target's embedding and LM head."""
    return str(make_eagle_head(tmp_path_factory.mktemp("eagle1"), hidden_size=256, vocab_size=4096, head_dim=64,
                               seed=4))  # fmt: skip


# A shared header: the third prompt, admitted after the first two, takes it from the verifier's prefix cache.
_HEADER = '"""Helpers for the parser, the printer and the tree walker of this module, with tests."""\n\n'
MODE_PROMPTS = [_HEADER + p for p in ("def parse(self, text):\n", "import os\nimport sys\n\n", "class Tree:\n    def")]
GREEDY = SamplingParams(temperature=0, max_tokens=20, ignore_eos=True)


def _greedy_tokens(config: dict | None) -> tuple[list[list[int]], list]:
    llm = LLM(model=str(BUNDLED_TARGET), speculative_config=config, max_num_seqs=2, batch_invariant=True)
    try:
        results = llm.generate(MODE_PROMPTS, GREEDY, use_tqdm=False)
    finally:
        llm.close()
    return [r.outputs[0].token_ids for r in results], results


@pytest.fixture(scope="module")
def ar_tokens() -> list[list[int]]:
    return _greedy_tokens(None)[0]


@pytest.mark.parametrize("spec", [{}, {"is_parallel": True, "force_pearl": True}, {"is_parallel": True},
                                  {"is_parallel": True, "tetris": True}, {"parallel_drafting": True},
                                  {"is_parallel": True, "force_pearl": True, "parallel_drafting": True},
                                  {"is_parallel": True, "parallel_drafting": True}],
                         ids=["sd", "pearl", "minedraft", "minedraft+tetris", "sd+p-eagle", "pearl+p-eagle",
                              "minedraft+p-eagle"])  # fmt: skip
def test_every_mode_with_a_random_eagle3_head_returns_ars_tokens(random_head, ar_tokens, spec) -> None:
    config = {"method": "eagle3", "model": random_head, "adaptive": False, "num_speculative_tokens": 3, **spec}
    tokens, results = _greedy_tokens(config)
    assert all(r.spec_decode_stats.num_draft_tokens > 0 for r in results), "the head drafted nothing"
    assert tokens == ar_tokens


@pytest.mark.parametrize("spec", [{}, {"is_parallel": True, "force_pearl": True}, {"is_parallel": True},
                                  {"is_parallel": True, "tetris": True}, {"is_parallel": True, "adaptive": True}],
                         ids=["sd", "pearl", "minedraft", "minedraft+tetris", "minedraft+adaptive"])  # fmt: skip
def test_every_mode_with_a_random_eagle1_head_returns_ars_tokens(random_eagle1_head, ar_tokens, spec) -> None:
    config = {"method": "eagle", "model": random_eagle1_head, "adaptive": False, "num_speculative_tokens": 3, **spec}
    tokens, results = _greedy_tokens(config)
    if not config["adaptive"]:  # adaptive k may rightly stop drafting for a head that is never right
        assert all(r.spec_decode_stats.num_draft_tokens > 0 for r in results), "the head drafted nothing"
    assert tokens == ar_tokens


@pytest.mark.parametrize("method", ["eagle", "eagle3"])
def test_the_config_reports_the_method(random_head, random_eagle1_head, method) -> None:
    head = random_eagle1_head if method == "eagle" else random_head
    config = EngineConfig(speculative_config={"method": method, "model": head})
    assert config.speculative_config.draft_method == method
    assert config.uses_eagle_head and str(config.draft_path) == head
    assert config.enable_prefix_caching


@pytest.mark.parametrize("cached", [False, True], ids=["computed", "cached-prefix"])
@pytest.mark.parametrize("kind", ["eagle", "eagle3"])
def test_each_window_is_what_the_head_drafts_from_the_targets_states_of_every_committed_position(
    tmp_path, target, kind, cached
) -> None:
    """The drafter's bookkeeping against a recomputation from scratch: after every step, the window equals
    the reference head run over the target's features of all committed positions (from a fresh target
    forward), then chained on its own outputs. Covers a prompt prefilled in two chunks, windows after
    rejections, positions caught up over several steps, and PEARL continuations; and a prompt whose first
    16 tokens the verifier takes from its prefix cache (their states come from the cache too)."""
    from minedraft.engine.eagle_drafter import EagleDraftWorker
    from minedraft.engine.plans import Admission, DraftPlan, DraftTask, PrefillTask, VerifyPlan, VerifyTask
    from minedraft.engine.workers import VerifyWorker

    # Weights large enough that the tokens, not only the hidden inputs, decide the drafts.
    head, layers, reference = _window_reference(tmp_path, target, kind)
    verifier = VerifyWorker(ModelRunner(target, max_seq_len=128, num_slots=2, aux_hidden_layers=layers,
                                        block_size=8, enable_prefix_caching=cached))  # fmt: skip
    drafter = EagleDraftWorker(_head_runner(head, target), support_size=4)
    fresh = ModelRunner(target, max_seq_len=128, aux_hidden_layers=layers)
    prompt = [(13 * i + 1) % VOCAB for i in range(21)]
    greedy = SamplingParams(temperature=0)
    if cached:  # an earlier request with the same first 18 tokens leaves two full blocks in the cache
        verifier.admit([Admission("earlier", prompt[:18] + [1, 2], greedy, seed=0)])
        verifier.verify(VerifyPlan([VerifyTask("earlier")]))
        verifier.release(["earlier"])
    for worker in (verifier, drafter):
        worker.admit([Admission("r", list(prompt), greedy, seed=0)])
    assert len(verifier.sequences["r"].kv_tokens) == (16 if cached else 0)

    def exchange() -> None:
        drafter.receive_features(verifier.take_features())
        drafter.apply_results(results)

    results = verifier.verify(VerifyPlan([], prefill=[PrefillTask("r", 12)]))  # the first chunk only
    exchange()
    results = verifier.verify(VerifyPlan([VerifyTask("r")]))  # the rest, and the first output token
    exchange()
    for _ in range(4):
        drafter.draft(DraftPlan([DraftTask("r", 3)]))
        window = drafter.take_drafts()["r"]
        tokens = verifier.sequences["r"].tokens
        expected = _reference_window(fresh, reference, tokens, 5)
        assert window.tokens == expected[:3]
        # PEARL: the window's continuation, drafted before the window is verified, goes on as its next steps would.
        drafter.draft(DraftPlan([DraftTask("r", 2, continue_window=True)]))
        assert drafter._windows["r"][1].tokens == expected[3:]  # held until the step's end decides on it
        verifier.receive_drafts({"r": window})
        results = verifier.verify(VerifyPlan([VerifyTask("r", keep_bonus=False)]))
        exchange()
        kept = drafter.take_drafts()
        assert ("r" in kept) == (verifier.sequences["r"].tokens == tokens + window.tokens)  # all accepted


def _window_reference(tmp_path, target: str, kind: str):
    """A random head of `kind` with large weights, the target states it reads, and its reference as a function
    (target features of positions 0 .. n - 1 [n, width] -> its hidden inputs; tokens, hidden -> logits, out)."""
    embedding = load_file(f"{target}/model.safetensors")["model.embed_tokens.weight"].float()
    if kind == "eagle":
        head = make_eagle_head(tmp_path / "head", hidden_size=HIDDEN, vocab_size=VOCAB, head_dim=16, seed=5,
                               init_std=0.4)  # fmt: skip
        weights, config = read_head_weights(head), json.loads((head / "config.json").read_text())
        run = lambda tokens, hidden: reference_eagle1(weights, config, embedding, embedding, tokens, hidden)  # noqa: E731
        return head, (4,), (lambda features: features, run)
    head = make_eagle3_head(tmp_path / "head", hidden_size=HIDDEN, vocab_size=VOCAB, head_dim=16, seed=5,
                            aux_layers=[0, 2, 3], init_std=0.4)  # fmt: skip
    weights, config = read_head_weights(head), json.loads((head / "config.json").read_text())
    fc = weights["fc.weight"].float()
    run = lambda tokens, hidden: reference_head(weights, config, embedding, tokens, hidden)  # noqa: E731
    return head, (0, 2, 3), (lambda features: features @ fc.T, run)


def _reference_window(fresh: ModelRunner, reference, tokens: list[int], k: int) -> list[int]:
    fuse, run = reference
    slot = fresh.allocate_slot()
    fresh.forward([SeqInput(slot, tokens, 0)])
    features = fuse(fresh.aux_hidden.float()[: len(tokens) - 1])
    fresh.free_slot(slot)
    inputs, hidden, window = list(tokens[1:]), list(features), []
    for _ in range(k):
        logits, out = run(inputs, torch.stack(hidden))
        window.append(int(logits[-1].argmax()))
        inputs.append(window[-1])
        hidden.append(out[-1])
    return window


def test_a_p_eagle_window_is_one_pass_over_masked_positions(tmp_path, target) -> None:
    """P-EAGLE: the window's first input, then k - 1 positions holding the mask token and fc(mask_hidden);
    row j gives draft token j + 1 (greedy: the reference's argmax at that row)."""
    from minedraft.engine.eagle_drafter import EagleDraftWorker
    from minedraft.engine.plans import Admission, DraftPlan, DraftTask, VerifyPlan, VerifyTask
    from minedraft.engine.workers import VerifyWorker

    head = make_eagle3_head(tmp_path / "head", hidden_size=HIDDEN, vocab_size=VOCAB, head_dim=16, seed=6,
                            aux_layers=[0, 2, 3], init_std=0.4, mask_token_id=7)  # fmt: skip
    weights = load_file(str(head / "model.safetensors"))
    config = json.loads((head / "config.json").read_text())
    embedding = load_file(f"{target}/model.safetensors")["model.embed_tokens.weight"].float()
    verifier = VerifyWorker(ModelRunner(target, max_seq_len=128, num_slots=2, aux_hidden_layers=(0, 2, 3)))
    drafter = EagleDraftWorker(_head_runner(head, target), support_size=4, parallel=True)
    fresh = ModelRunner(target, max_seq_len=128, aux_hidden_layers=(0, 2, 3))
    for worker in (verifier, drafter):
        worker.admit([Admission("r", [(5 * i + 2) % VOCAB for i in range(9)], SamplingParams(temperature=0), 0)])
    results = verifier.verify(VerifyPlan([VerifyTask("r")]))
    for _ in range(3):
        drafter.receive_features(verifier.take_features())
        drafter.apply_results(results)
        drafter.draft(DraftPlan([DraftTask("r", 4)]))
        window = drafter.take_drafts()["r"]
        tokens = verifier.sequences["r"].tokens
        slot = fresh.allocate_slot()
        fresh.forward([SeqInput(slot, tokens, 0)])
        fc = weights["fc.weight"].float()
        features = fresh.aux_hidden.float()[: len(tokens) - 1] @ fc.T
        fresh.free_slot(slot)
        masked = (weights["mask_hidden"].float() @ fc.T).expand(3, -1)
        logits, _ = reference_head(weights, config, embedding, tokens[1:] + [7] * 3, torch.cat((features, masked)))
        assert window.tokens == logits[-4:].argmax(-1).tolist()
        verifier.receive_drafts({"r": window})
        results = verifier.verify(VerifyPlan([VerifyTask("r")]))
