"""`minedraft bench` from the command line against a real `minedraft up --http-port` stack (tiny pair, MineDraft
mode): the OpenAI backends (completions, chat) and gRPC with one request generator, vLLM's figures checked
against the per-request trace they come from, the figure, `bench compare`, the progress lines of a run whose
stdout is not a terminal. Never speed.
"""

from __future__ import annotations

import json
import shutil
import signal
import statistics
import subprocess
import sys
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import matplotlib.image
import pytest

from minedraft.bench.backends import read_spec_decode_metrics
from minedraft.bench.records import RequestRecord
from minedraft.stack.local import free_port

CHAT_TEMPLATE = "{% for m in messages %}{{ m.content }}{% endfor %}"
NUM_PROMPTS, OUTPUT_LEN = 10, 10
PERCENTILES = ("50", "90", "99")


@dataclass(frozen=True)
class Up:
    grpc: str
    http: str
    metrics: str
    tokenizer: str


@pytest.fixture(scope="module")
def up(pair, tmp_path_factory) -> Iterator[Up]:
    root = tmp_path_factory.mktemp("bench-http")
    target = root / "target"  # a copy with a chat template, for /v1/chat/completions
    shutil.copytree(pair[0], target)
    (target / "tokenizer_config.json").write_text(json.dumps({"chat_template": CHAT_TEMPLATE}))
    port, http_port, metrics_port = free_port(), free_port(), free_port()
    # Fixed k: the report's acceptance is checked, and adaptive speculation may rightly stop drafting here.
    spec = {"num_speculative_tokens": 3, "is_parallel": True, "model": pair[1], "adaptive": False}
    process = subprocess.Popen(
        [sys.executable, "-m", "minedraft", "up", "--model", str(target), "--speculative-config", json.dumps(spec),
         "--device", "cpu", "--max-model-len", "128", "--port", str(port), "--http-port", str(http_port),
         "--metrics-port", str(metrics_port), "--per-request-spec-decode-metrics", "summary", "--log-level",
         "WARNING"],
        stdout=subprocess.PIPE, text=True,
    )  # fmt: skip
    try:
        assert "is serving on" in process.stdout.readline()
        assert "OpenAI-compatible API" in process.stdout.readline()
        yield Up(f"127.0.0.1:{port}", f"http://127.0.0.1:{http_port}", f"http://127.0.0.1:{metrics_port}/metrics",
                 str(target))  # fmt: skip
    finally:
        process.send_signal(signal.SIGTERM)
        try:
            process.wait(timeout=60)
        finally:
            if process.poll() is None:
                process.kill()


def bench(*flags: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "minedraft", "bench", *flags], capture_output=True, text=True,
                          timeout=300)  # fmt: skip


def random_load(up: Up) -> list[str]:
    """The same random requests for every backend: lengths spread by half around 24 in and 10 out."""
    return ["--dataset", "random", "--input-len", "24", "--output-len", str(OUTPUT_LEN), "--random-range-ratio",
            "0.5", "--ignore-eos", "--tokenizer", up.tokenizer, "--num-prompts", str(NUM_PROMPTS), "--concurrency",
            "3", "--warmup", "1", "--percentiles", ",".join(PERCENTILES)]  # fmt: skip


@pytest.fixture(scope="module")
def openai_run(up: Up, tmp_path_factory) -> tuple[subprocess.CompletedProcess, Path]:
    out = tmp_path_factory.mktemp("openai")
    done = bench(
        "--backend", "openai", "--base-url", up.http, *random_load(up), "--request-rate", "40", "--burstiness", "0.5",
        "--slo", "ttft:60000,tpot:60000", "--metrics-url", up.metrics, "--progress-interval", "0.02",
        "--json", str(out / "run.json"), "--trace", str(out / "trace.jsonl"), "--plot", str(out / "run.png"),
    )  # fmt: skip
    assert done.returncode == 0, done.stderr + done.stdout
    return done, out


def test_openai_run_reports_vllms_figures(openai_run) -> None:
    done, out = openai_run
    data = json.loads((out / "run.json").read_text())
    assert (data["backend"], data["server_mode"], data["completed"], data["failed"]) == ("openai", "minedraft",
                                                                                         NUM_PROMPTS, 0)
    for name in ("ttft", "tpot", "itl", "e2el"):
        assert f"Mean {name.upper()} (ms)" in done.stdout
        values = [data[f"{kind}_{name}_ms"] for kind in ("mean", "median", "std", *(f"p{p}" for p in PERCENTILES))]
        assert all(v is not None and v >= 0 for v in values), name
    assert data["median_ttft_ms"] == data["p50_ttft_ms"] <= data["p90_ttft_ms"] <= data["p99_ttft_ms"]
    # Generous limits: every request is good, so goodput equals the request throughput.
    assert data["request_goodput"] == data["request_throughput"] > 0
    assert data["total_token_throughput"] == pytest.approx(data["input_throughput"] + data["output_throughput"])
    # The server counted the tokens it delivered during the run: exactly the usage the client summed.
    assert data["minedraft"]["server"]["generation_tokens"] == data["total_output_tokens"]
    assert data["minedraft"]["mean_tokens_per_chunk"] is None  # HTTP chunks carry text, not token counts


def test_figures_follow_from_the_trace(openai_run) -> None:
    """TTFT, TPOT, ITL (one per gap between chunks) and E2EL recomputed from the trace, request by request."""
    _, out = openai_run
    data = json.loads((out / "run.json").read_text())
    lines = [json.loads(line) for line in (out / "trace.jsonl").read_text().splitlines()]
    assert [r["index"] for r in lines] == list(range(NUM_PROMPTS)) and not any(r["error"] for r in lines)
    gaps, tpots = [], []
    for r in lines:
        times = [t for t, _ in r["chunks"]]
        assert r["ttft_s"] == times[0] and times == sorted(times) and times[-1] <= r["e2el_s"]
        assert all(n is None for _, n in r["chunks"]) and 1 <= len(times) <= r["output_tokens"]
        assert OUTPUT_LEN // 2 <= r["output_tokens"] <= OUTPUT_LEN * 3 // 2 and r["finish_reason"] == "length"
        assert 1 <= r["prompt_tokens"] <= 36 and 0 <= r["arrival_s"] <= r["sent_s"]
        gaps += [b - a for a, b in zip(times, times[1:])]
        tpots.append((r["e2el_s"] - r["ttft_s"]) / (r["output_tokens"] - 1))
    assert data["median_itl_ms"] == pytest.approx(statistics.median(gaps) * 1e3)
    assert data["mean_tpot_ms"] == pytest.approx(statistics.fmean(tpots) * 1e3)
    assert data["mean_ttft_ms"] == pytest.approx(statistics.fmean(r["ttft_s"] for r in lines) * 1e3)
    assert data["total_output_tokens"] == sum(r["output_tokens"] for r in lines)
    assert data["total_input_tokens"] == sum(r["prompt_tokens"] for r in lines)
    # Released by a seeded gamma process at 40 req/s: the arrivals rise and span about n / rate seconds.
    arrivals = [r["arrival_s"] for r in lines]
    assert arrivals == sorted(arrivals) and 0.02 < arrivals[-1] < 5


def test_acceptance_from_the_responses_without_metrics_url(up: Up, tmp_path) -> None:
    """The server reports each request's drafts (`--per-request-spec-decode-metrics summary`): the report and
    its JSON show the mean accepted length and the acceptance per draft position (from vLLM's acceptance
    histogram) with no scrape of the server's counters."""
    done = bench("--backend", "openai", "--base-url", up.http, *random_load(up), "--json", str(tmp_path / "run.json"),
                 "--trace", str(tmp_path / "trace.jsonl"))  # fmt: skip
    assert done.returncode == 0, done.stderr + done.stdout
    data = json.loads((tmp_path / "run.json").read_text())
    records = [json.loads(line) for line in (tmp_path / "trace.jsonl").read_text().splitlines()]
    assert data["minedraft"]["server"] is None  # nothing scraped
    assert all(r["num_drafts"] > 0 for r in records)  # fixed k: every request drafted
    drafts, accepted = sum(r["num_drafts"] for r in records), sum(r["num_accepted_tokens"] for r in records)
    assert data["minedraft"]["mean_accepted_length"] == pytest.approx(1 + accepted / drafts)
    rates = data["minedraft"]["acceptance_per_position"]
    assert 1 <= len(rates) <= 3 and rates == sorted(rates, reverse=True)  # a position needs the one before it
    assert sum(rates) * drafts == pytest.approx(accepted)
    shown = {line.split(":")[0]: line.split(":", 1)[1].strip() for line in done.stdout.splitlines() if ":" in line}
    assert float(shown["Mean accepted length"]) >= 1
    assert [float(r) for r in shown["Acceptance per draft position"].split()] == pytest.approx(rates, abs=0.005)


def test_the_figure_is_a_png(openai_run) -> None:
    _, out = openai_run
    image = matplotlib.image.imread(out / "run.png")
    assert image.ndim == 3 and image.shape[0] > 200 and image.shape[1] > 600
    assert image.std() > 0.05  # something drawn, not a blank canvas


def test_progress_lines_when_stdout_is_no_terminal(openai_run) -> None:
    done, _ = openai_run
    progress = [line for line in done.stdout.splitlines() if line.startswith("progress: ")]
    assert progress and "requests done" in progress[0]


def test_grpc_and_openai_take_the_same_load_and_compare(up: Up, openai_run, tmp_path) -> None:
    _, out = openai_run
    done = bench("--target", up.grpc, *random_load(up), "--request-rate", "40", "--burstiness", "0.5", "--json",
                 str(tmp_path / "grpc.json"), "--trace", str(tmp_path / "grpc.jsonl"))  # fmt: skip
    assert done.returncode == 0, done.stderr + done.stdout
    grpc, http = json.loads((tmp_path / "grpc.json").read_text()), json.loads((out / "run.json").read_text())
    # The same dataset and seed: the same prompts and output lengths whichever way they travel.
    assert (grpc["total_input_tokens"], grpc["total_output_tokens"]) == (http["total_input_tokens"],
                                                                         http["total_output_tokens"])
    assert grpc["minedraft"]["mean_tokens_per_chunk"] >= 1 and grpc["minedraft"]["mean_accepted_length"] >= 1
    table = bench("compare", str(out / "run.json"), str(tmp_path / "grpc.json"))
    assert table.returncode == 0, table.stderr
    rows = {line.split()[0]: line.split()[1:] for line in table.stdout.splitlines() if line.strip()}
    a, b, diff, ratio = (float(x) for x in rows["output_throughput"])
    assert (a, b) == (pytest.approx(http["output_throughput"], abs=0.01), pytest.approx(grpc["output_throughput"],
                                                                                          abs=0.01))
    assert diff == pytest.approx(b - a, abs=0.02) and ratio == pytest.approx(b / a, abs=0.01)
    assert "p99_itl_ms" in rows and "median_e2el_ms" in rows


def test_chat_backend_and_a_concurrency_sweep(up: Up, tmp_path) -> None:
    done = bench(
        "--backend", "openai-chat", "--base-url", up.http, "--dataset", "random", "--tokenizer", up.tokenizer,
        "--input-len", "16", "--num-prompts", "4", "--max-tokens", "6", "--ignore-eos", "--sweep-concurrency", "1,2",
        "--warmup", "0", "--json", str(tmp_path / "sweep.json"), "--plot", str(tmp_path / "sweep.png"),
    )  # fmt: skip
    assert done.returncode == 0, done.stderr + done.stdout
    runs = json.loads((tmp_path / "sweep.json").read_text())
    assert list(runs) == ["concurrency 1", "concurrency 2"]
    for concurrency, run in zip((1, 2), runs.values()):
        assert (run["backend"], run["max_concurrency"], run["completed"]) == ("openai-chat", concurrency, 4)
        assert run["total_output_tokens"] == 4 * 6 and run["mean_ttft_ms"] > 0
    assert matplotlib.image.imread(tmp_path / "sweep.png").shape[1] > 800  # four panels


def test_errors_a_user_can_fix() -> None:
    nobody = f"http://127.0.0.1:{free_port()}"
    done = bench("--base-url", nobody, "--num-prompts", "1")
    assert done.returncode == 1 and "no OpenAI-compatible server answers" in done.stderr
    for flags, message in (
        (["--base-url", "127.0.0.1:1"], "must be an http:// or https:// URL"),
        (["--backend", "openai", "--target", "127.0.0.1:1"], "needs --base-url"),
        (["--target", "127.0.0.1:1", "--slo", "itl:5"], "keys are ttft, tpot, e2el"),
        (["--target", "127.0.0.1:1", "--ramp-up-strategy", "linear"], "--ramp-up-start-rps"),
        (["--dataset", "random", "--random-range-ratio", "1", "--target", "127.0.0.1:1"], "random-range-ratio"),
        (["--target", "127.0.0.1:1", "--sweep-concurrency", "1,x"], "integers >= 1"),
    ):
        done = bench(*flags)
        assert done.returncode == 2 and message in done.stderr, (flags, done.stderr)


def test_vllms_per_request_metrics_read_alike() -> None:
    """vLLM's `metrics.speculative_decoding` (the example in its PR): the histogram gives the positions."""
    record = RequestRecord(index=0)
    read_spec_decode_metrics({"mean_acceptance_length": 1.2325581395348837, "draft_acceptance_rate": 0.0775,
                              "acceptance_histogram": [39, 1, 0, 3], "num_spec_steps": 43,
                              "num_accepted_draft_tokens": 10, "num_draft_tokens": 129, "num_spec_tokens": 3},
                             record)  # fmt: skip
    assert (record.num_drafts, record.num_draft_tokens, record.num_accepted_tokens) == (43, 129, 10)
    assert record.accepted_per_pos == [4, 3, 3]
