"""Request lifecycle without a model: detokenization, stop conditions, statistics."""

from __future__ import annotations

import pytest
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

from minedraft.engine.detokenizer import IncrementalDetokenizer
from minedraft.engine.request import Request, SpecDecodeStats
from minedraft.sampling.params import SamplingParams

EOS = "<|endoftext|>"


class _Decoder:
    """The `tokenizers` library behind the small interface the engine uses."""

    def __init__(self, tok: Tokenizer) -> None:
        self.tok = tok

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        return self.tok.decode(ids, skip_special_tokens=skip_special_tokens)

    def encode(self, text: str) -> list[int]:
        return self.tok.encode(text).ids


@pytest.fixture(scope="module")
def tokenizer() -> _Decoder:
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=300, special_tokens=[EOS], initial_alphabet=pre_tokenizers.ByteLevel.alphabet()
    )
    tok.train_from_iterator(["hello world, def main(): return 42\n"] * 20, trainer)
    return _Decoder(tok)


def _request(tokenizer: _Decoder, params: SamplingParams, prompt: str = "hi", max_model_len: int = 512) -> Request:
    return Request.create(
        "r",
        tokenizer.encode(prompt),
        params,
        seed=0,
        max_model_len=max_model_len,
        eos_token_ids=frozenset([tokenizer.tok.token_to_id(EOS)]),
        tokenizer=tokenizer,
    )


def test_multibyte_text_streams_without_broken_characters(tokenizer: _Decoder) -> None:
    text = "héllo wörld → 世界 🙂 done"
    ids = tokenizer.encode(text)
    assert len(ids) > len(text.encode()) // 2, "the untrained characters must be split into byte tokens"
    detok = IncrementalDetokenizer(tokenizer, tokenizer.encode("prompt"))
    deltas = [detok.add(i) for i in ids] + [detok.flush()]
    assert "".join(deltas) == text
    assert all("\ufffd" not in d for d in deltas)
    assert any(d == "" for d in deltas), "some tokens end mid-character and must be held back"


def test_a_resumed_stream_continues_the_text_at_any_break(tokenizer: _Decoder) -> None:
    """Resumed after any token (a break inside a character included), the text streamed before the break plus
    the text of the resumed run is the text of one run: the resumed tokens are replayed, not taken as prompt."""
    text, prompt = "héllo wörld → 世界 🙂 done", tokenizer.encode("prompt")
    ids = tokenizer.encode(text)
    for cut in range(1, len(ids)):
        before = IncrementalDetokenizer(tokenizer, prompt)
        streamed = "".join(before.add(i) for i in ids[:cut])
        after = IncrementalDetokenizer(tokenizer, prompt + ids[:cut], resumed_tokens=cut)
        assert streamed + "".join(after.add(i) for i in ids[cut:]) + after.flush() == text, f"break after {cut}"


def test_tokens_after_eos_are_dropped(tokenizer: _Decoder) -> None:
    req = _request(tokenizer, SamplingParams(temperature=0, max_tokens=50))
    eos = tokenizer.tok.token_to_id(EOS)
    tail = tokenizer.encode(" world")
    req.append_tokens(tokenizer.encode("hello") + [eos] + tail)
    assert req.finish_reason == "stop"
    assert req.output_ids[-1] == eos and req.text == "hello"


def test_ignore_eos_and_stop_token_ids(tokenizer: _Decoder) -> None:
    eos = tokenizer.tok.token_to_id(EOS)
    req = _request(tokenizer, SamplingParams(temperature=0, max_tokens=50, ignore_eos=True))
    req.append_tokens([eos] + tokenizer.encode("hello"))
    assert not req.finished
    ids = tokenizer.encode("hello world again")
    req = _request(tokenizer, SamplingParams(temperature=0, max_tokens=50, stop_token_ids=[ids[1]]))
    req.append_tokens(ids)
    assert req.finish_reason == "stop" and req.output_ids == ids[:2]


def test_max_tokens_and_max_model_len(tokenizer: _Decoder) -> None:
    req = _request(tokenizer, SamplingParams(temperature=0, max_tokens=3))
    req.append_tokens(tokenizer.encode("hello world, def main()"))
    assert req.finish_reason == "length" and len(req.output_ids) == 3
    prompt_len = len(tokenizer.encode("hello world"))
    req = _request(tokenizer, SamplingParams(max_tokens=100), prompt="hello world", max_model_len=prompt_len + 2)
    assert req.max_new_tokens == 2


@pytest.mark.parametrize("stop", ["wor", "o w", "world, def"])
def test_stop_string_cuts_text_and_stream(tokenizer: _Decoder, stop: str) -> None:
    req = _request(tokenizer, SamplingParams(temperature=0, max_tokens=100, stop=[stop, "zzz"]))
    streamed = ""
    for token in tokenizer.encode("hello world, def main(): return 42"):
        req.append_tokens([token])
        streamed += req.take_stream_delta()
        if req.finished:
            break
    expected = "hello world, def main(): return 42".split(stop)[0]
    assert req.finish_reason == "stop"
    assert req.text == expected
    assert streamed == expected, "streamed text must never show part of a stop string"


def test_bad_prompts_are_rejected(tokenizer: _Decoder) -> None:
    with pytest.raises(ValueError, match="empty"):
        _request(tokenizer, SamplingParams(), prompt="")
    with pytest.raises(ValueError, match="max_model_len is 3"):
        _request(tokenizer, SamplingParams(), prompt="hello world, def main()", max_model_len=3)


def test_spec_decode_stats() -> None:
    stats = SpecDecodeStats()
    stats.record(num_draft_tokens=4, num_accepted=2)
    stats.record(num_draft_tokens=4, num_accepted=4)
    stats.record(num_draft_tokens=0, num_accepted=0)  # a plain decode step is not a draft
    assert stats.num_drafts == 2 and stats.num_draft_tokens == 8 and stats.num_accepted_tokens == 6
    assert stats.num_accepted_tokens_per_pos == [2, 2, 1, 1]
    assert stats.mean_accepted_length == pytest.approx(4.0)
    total = SpecDecodeStats()
    total.merge(stats)
    total.merge(stats)
    assert total.num_accepted_tokens_per_pos == [4, 4, 2, 2]
