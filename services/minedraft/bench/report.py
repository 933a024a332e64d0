"""What a benchmark run leaves to read: the report, a JSON of its figures under vLLM's keys
(`mean_ttft_ms`, `p99_itl_ms`, `output_throughput`, ...), a per-request trace (JSON lines), a comparison of
two such JSON files, and a figure.
"""

from __future__ import annotations

import json
import math
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from minedraft.bench.records import LATENCIES, BenchResult, LatencyStats, RequestRecord
from minedraft.bench.server_metrics import ServerStepStats

TITLES = {"ttft": "TTFT", "tpot": "TPOT", "itl": "ITL", "e2el": "E2EL"}
HEADINGS = {
    "ttft": "Time to first token",
    "tpot": "Time per output token (after the first)",
    "itl": "Inter-token latency (between chunks)",
    "e2el": "End-to-end latency",
}


def percentile_key(p: float) -> str:
    """vLLM's spelling: 99 -> 'p99', 99.9 -> 'p99.9'."""
    return f"p{int(p)}" if float(p).is_integer() else f"p{p}"


def _num(value: float | None) -> float | None:
    return None if value is None or (isinstance(value, float) and math.isnan(value)) else value


def _fmt(value: float | None, fmt: str = ".2f", scale: float = 1.0) -> str:
    value = _num(value)
    return "-" if value is None else format(value * scale, fmt)


def latency_fields(name: str, stats: LatencyStats) -> dict[str, float | None]:
    """vLLM's keys of one latency, in milliseconds: mean_ttft_ms, median_ttft_ms, std_ttft_ms, p99_ttft_ms."""
    fields = {f"mean_{name}_ms": stats.mean, f"median_{name}_ms": stats.median, f"std_{name}_ms": stats.std}
    fields |= {f"{percentile_key(p)}_{name}_ms": v for p, v in stats.percentiles.items()}
    return {k: _num(v * 1e3) for k, v in fields.items()}


def format_result(result: BenchResult) -> str:
    """A human-readable report of one run: vLLM's figures, then ours."""
    rate = "as fast as concurrency allows" if result.request_rate is None else f"{result.request_rate:g}/s"
    if result.request_rate is not None and result.burstiness != 1.0:
        rate += f", burstiness {result.burstiness:g}"
    rows = [
        ("Backend, target", f"{result.backend} {result.target}" + (f" ({result.server_mode})" if result.server_mode
                                                                   else "")),
        ("Successful / failed requests", f"{len(result.ok)} / {result.failed}"),
        ("Maximum request concurrency", str(result.concurrency)),
        ("Request rate", rate),
        ("Benchmark duration (s)", f"{result.duration_s:.2f}"),
        ("Total input tokens", str(result.input_tokens)),
        ("Total generated tokens", str(result.output_tokens)),
        ("Request throughput (req/s)", _fmt(result.request_throughput)),
    ]  # fmt: skip
    if result.slo:
        slo = ", ".join(f"{k} <= {v:g} ms" for k, v in result.slo.items())
        rows.append(("Request goodput (req/s)", f"{_fmt(result.request_goodput)}  ({slo})"))
    rows += [
        ("Input token throughput (tok/s)", _fmt(result.input_throughput)),
        ("Output token throughput (tok/s)", _fmt(result.output_throughput)),
        ("Total token throughput (tok/s)", _fmt(result.total_token_throughput)),
    ]
    lines = [f"{' MineDraft benchmark ' + result.label + ' ':=^60}"] + [f"{k + ':':<40}{v}" for k, v in rows]
    if result.first_error:
        lines.append(f"{'First error:':<40}{result.first_error}")
    for name in LATENCIES:
        stats, title = result.latency(name), TITLES[name]
        lines.append(f"{' ' + HEADINGS[name] + ' ':-^60}")
        lines += [f"{f'{label} {title} (ms):':<40}{_fmt(value, '.2f', 1e3)}" for label, value in (
            ("Mean", stats.mean), ("Median", stats.median), ("Std", stats.std),
            *((percentile_key(p).upper(), v) for p, v in stats.percentiles.items()))]  # fmt: skip
    lines.append(f"{' MineDraft (not vLLM figures) ':-^60}")
    lines.append(f"{'Mean accepted length:':<40}{_fmt(result.mean_accepted_length)}")
    lines.append(f"{'Mean tokens per chunk:':<40}{_fmt(result.mean_tokens_per_chunk)}")
    if result.acceptance_per_position:
        rates = " ".join(f"{r:.2f}" for r in result.acceptance_per_position)
        lines.append(f"{'Acceptance per draft position:':<40}{rates}")
    if result.server is not None:
        lines += _format_server(result.server)
    lines.append("=" * 60)
    return "\n".join(lines)


def _format_server(s: ServerStepStats) -> list[str]:
    idle = ", ".join(f"{role} {share:.1%}" for role, share in s.worker_idle_share.items()) or "-"
    lines = [
        "Server (scheduler metrics over the run)",
        f"{'  steps (draft, verify, both):':<40}{s.steps} ({s.draft_steps}, {s.verify_steps}, {s.overlap_steps})",
        f"{'  mean step / draft / verify (ms):':<40}{_fmt(s.mean_step_seconds, '.2f', 1e3)} / "
        f"{_fmt(s.mean_draft_seconds, '.2f', 1e3)} / {_fmt(s.mean_verify_seconds, '.2f', 1e3)}",
        f"{'  control-plane overhead (approx.):':<40}{_fmt(s.control_plane_overhead, '.1%')}",
        f"{'  overlap efficiency:':<40}{_fmt(s.overlap_efficiency, '.2f')}",
        f"{'  worker idle (share of wall):':<40}{idle}",
        f"{'  prefix cache hit rate:':<40}{_fmt(s.prefix_cache_hit_rate, '.1%')} ({s.prefix_cache_hits} of "
        f"{s.prefix_cache_queries} prompt tokens)",
    ]
    if s.mean_chosen_k is not None:
        windows = ", ".join(f"{k}: {n}" for k, n in sorted(s.chosen_k.items()))
        lines.append(f"{'  adaptive k:':<40}mean {s.mean_chosen_k:.2f}, plain steps {s.plain_steps} "
                     f"(windows by k: {windows})")  # fmt: skip
    return lines


def trace_line(record: RequestRecord, label: str = "") -> dict[str, Any]:
    """One request of the trace: when the generator released it and when it was sent (seconds after the run's
    start; the difference is the wait for a free slot under --concurrency), its TTFT and E2EL, and every chunk
    carrying output as [seconds after send, tokens or null where the stream does not say]."""
    return {
        "label": label, "index": record.index, "arrival_s": record.arrival, "sent_s": record.sent,
        "ttft_s": record.ttft, "e2el_s": record.e2el,
        "prompt_tokens": record.prompt_tokens, "output_tokens": record.output_tokens,
        "finish_reason": record.finish_reason, "error": record.error,
        "chunks": [[t, n] for t, n in zip(record.chunk_times, record.chunk_tokens)],
        "num_drafts": record.num_drafts, "num_draft_tokens": record.num_draft_tokens,
        "num_accepted_tokens": record.num_accepted_tokens, "accepted_per_pos": record.accepted_per_pos,
    }  # fmt: skip


def write_trace(results: Mapping[str, BenchResult], path: str | Path) -> None:
    with open(path, "w", encoding="utf-8") as out:
        for label, result in results.items():
            for record in sorted(result.records, key=lambda r: r.index):
                out.write(json.dumps(trace_line(record, label), ensure_ascii=False) + "\n")


def to_dict(result: BenchResult, per_request: bool = False) -> dict[str, Any]:
    """The run's configuration and figures: vLLM's keys (ms, tok/s) and ours under `minedraft`."""
    data: dict[str, Any] = {
        "label": result.label, "backend": result.backend, "target": result.target, "server_mode": result.server_mode,
        "max_concurrency": result.concurrency, "request_rate": result.request_rate,
        "burstiness": result.burstiness, "max_tokens": result.max_tokens, "temperature": result.temperature,
        "percentiles": list(result.percentiles), "slo_ms": result.slo,
        "duration": result.duration_s, "completed": len(result.ok), "failed": result.failed,
        "first_error": result.first_error, "total_input_tokens": result.input_tokens,
        "total_output_tokens": result.output_tokens, "request_throughput": _num(result.request_throughput),
        "request_goodput": _num(result.request_goodput), "input_throughput": _num(result.input_throughput),
        "output_throughput": _num(result.output_throughput),
        "total_token_throughput": _num(result.total_token_throughput),
    }  # fmt: skip
    for name in LATENCIES:
        data |= latency_fields(name, result.latency(name))
    data["minedraft"] = {
        "mean_accepted_length": result.mean_accepted_length,
        "mean_tokens_per_chunk": result.mean_tokens_per_chunk,
        "acceptance_per_position": result.acceptance_per_position,
        "server": result.server.to_dict() if result.server else None,
    }
    if per_request:
        data["requests"] = [trace_line(r) | {"token_ids": r.token_ids} for r in result.records]
    return data


def to_json(results: BenchResult | Mapping[str, BenchResult], per_request: bool = False) -> str:
    """JSON of one result, or of several keyed by name (the modes of --launch, the points of a sweep)."""
    if isinstance(results, BenchResult):
        return json.dumps(to_dict(results, per_request), indent=2)
    return json.dumps({name: to_dict(r, per_request) for name, r in results.items()}, indent=2)


# --- comparing two result files ----------------------------------------------------------------------------

COMPARED = ("request_throughput", "request_goodput", "input_throughput", "output_throughput",
            "total_token_throughput")  # fmt: skip


def runs_of(data: Mapping[str, Any]) -> dict[str, Mapping[str, Any]]:
    """The runs of a result file: itself when it is one run (ours or `vllm bench serve --save-result`'s),
    else its values that are runs (a --launch or sweep file keyed by name)."""
    if "completed" in data:
        return {"": data}
    return {name: run for name, run in data.items() if isinstance(run, Mapping) and "completed" in run}


def _compared_keys(a: Mapping[str, Any], b: Mapping[str, Any]) -> list[str]:
    latency = [k for k in a if k.endswith("_ms") and k.split("_")[1] in LATENCIES and k in b]
    return [k for k in COMPARED if k in a and k in b] + latency


def compare(a: Mapping[str, Any], b: Mapping[str, Any], names: tuple[str, str] = ("A", "B")) -> str:
    """A table of the figures both files have: A, B, B - A and B / A, for every run name they share."""
    runs_a, runs_b = runs_of(a), runs_of(b)
    if len(runs_a) == len(runs_b) == 1:  # two single runs: whatever their names
        pairs = [(next(iter(runs_a)), next(iter(runs_b)))]
    else:
        pairs = [(name, name) for name in runs_a if name in runs_b]
    if not pairs:
        raise ValueError(f"no run to compare: {names[0]} has {sorted(runs_a) or 'none'}, {names[1]} has "
                         f"{sorted(runs_b) or 'none'}")  # fmt: skip
    lines = []
    for key_a, key_b in pairs:
        run_a, run_b = runs_a[key_a], runs_b[key_b]
        title = key_a or "run"
        lines.append(f"{title:<28}{names[0]:>14}{names[1]:>14}{'B - A':>12}{'B / A':>8}")
        for key in _compared_keys(run_a, run_b):
            va, vb = run_a[key], run_b[key]
            if va is None or vb is None:
                lines.append(f"{key:<28}{_fmt(va):>14}{_fmt(vb):>14}{'-':>12}{'-':>8}")
                continue
            ratio = _fmt(vb / va) if va else "-"
            lines.append(f"{key:<28}{va:>14.2f}{vb:>14.2f}{vb - va:>+12.2f}{ratio:>8}")
        lines.append("")
    return "\n".join(lines).rstrip() + "\n(throughputs: higher is better; *_ms latencies: lower is better)"


def compare_files(path_a: str | Path, path_b: str | Path) -> str:
    data = []
    for path in (path_a, path_b):
        try:
            data.append(json.loads(Path(path).read_text(encoding="utf-8")))
        except json.JSONDecodeError as exc:
            raise ValueError(f"{path} is not JSON: {exc}") from exc
    return compare(data[0], data[1], (Path(path_a).stem[:13], Path(path_b).stem[:13]))


# --- the figure ---------------------------------------------------------------------------------------------


def plot(results: Mapping[str, BenchResult], path: str | Path, sweep: bool = False) -> None:
    """Throughput and latency percentiles per run; acceptance per draft position where known; with `sweep`
    (runs at rising concurrency), output tok/s and TTFT against concurrency."""
    import matplotlib

    matplotlib.use("Agg")  # files only, no display
    import matplotlib.pyplot as plt

    panels = 4 if sweep else 3
    fig, axes = plt.subplots(1, panels, figsize=(5.2 * panels, 4.2))
    names = [name or r.backend for name, r in results.items()]
    runs = list(results.values())
    _plot_throughput(axes[0], names, runs)
    _plot_latency(axes[1], names, runs)
    _plot_acceptance(axes[2], names, runs)
    if sweep:
        _plot_sweep(axes[3], runs)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def _plot_throughput(ax, names: list[str], runs: list[BenchResult]) -> None:
    width = 0.8 / 3
    for i, (key, label) in enumerate((("input_throughput", "input"), ("output_throughput", "output"),
                                      ("total_token_throughput", "total"))):  # fmt: skip
        ax.bar([x + i * width for x in range(len(runs))], [getattr(r, key) for r in runs], width, label=label)
    ax.set_xticks([x + width for x in range(len(runs))], names, rotation=20, fontsize=8)
    ax.set_ylabel("tokens / s")
    ax.set_title("Token throughput")
    ax.legend(fontsize=8)


def _plot_latency(ax, names: list[str], runs: list[BenchResult]) -> None:
    """Per latency and run, a bar at the median and a marker per percentile."""
    width = 0.8 / max(len(runs), 1)
    for j, (name, run) in enumerate(zip(names, runs)):
        xs = [i + j * width for i in range(len(LATENCIES))]
        stats = [run.latency(m) for m in LATENCIES]
        bars = ax.bar(xs, [_num(s.median * 1e3) or 0 for s in stats], width, label=f"{name} median")
        for p in run.percentiles:
            ax.scatter(xs, [_num(s.percentiles[p] * 1e3) or 0 for s in stats], marker="_", s=200,
                       color=bars.patches[0].get_facecolor())  # fmt: skip
    ax.set_xticks([i + width * (len(runs) - 1) / 2 for i in range(len(LATENCIES))], [TITLES[m] for m in LATENCIES])
    if any(_num(run.latency(m).median) for run in runs for m in LATENCIES):  # log of nothing warns
        ax.set_yscale("log")
    ax.set_ylabel("ms")
    points = ", ".join(percentile_key(p) for p in runs[0].percentiles) if runs else ""
    ax.set_title(f"Latency: median (bars), {points} (ticks)")
    ax.legend(fontsize=7)


def _plot_acceptance(ax, names: list[str], runs: list[BenchResult]) -> None:
    shown = False
    for name, run in zip(names, runs):
        rates = run.acceptance_per_position
        if rates:
            ax.plot(range(1, len(rates) + 1), rates, marker="o", label=name)
            ax.set_xticks(range(1, len(rates) + 1))
            shown = True
    ax.set_title("Acceptance per draft position")
    ax.set_xlabel("draft position")
    ax.set_ylabel("share of verifications accepting it")
    if shown:
        ax.set_ylim(0, 1.05)
        ax.legend(fontsize=8)
    else:
        unknown = ("not known: no drafts, or neither the gRPC stream,\nthe responses' per-request metrics nor "
                   "--metrics-url\nreported them")
        ax.text(0.5, 0.5, unknown, ha="center", va="center", transform=ax.transAxes)


def _plot_sweep(ax, runs: list[BenchResult]) -> None:
    concurrency = [r.concurrency for r in runs]
    ax.plot(concurrency, [r.output_throughput for r in runs], marker="o", color="C0", label="output tok/s")
    ax.set_xscale("log", base=2)
    ax.set_xlabel("concurrency")
    ax.set_ylabel("output tok/s", color="C0")
    twin = ax.twinx()
    twin.plot(concurrency, [_num(r.ttft.median * 1e3) for r in runs], marker="s", linestyle="--", color="C3")
    twin.set_ylabel("median TTFT (ms)", color="C3")
    ax.set_title("Throughput and TTFT against concurrency")
