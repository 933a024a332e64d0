"""benchmarks/openai_serve.py's client table from measured results (the comparison itself needs vLLM's CPU build
and minutes of every core, so it is not run here): per server, the median round of vLLM's client and of ours."""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))

import openai_serve  # noqa: E402


def _round(ttft: float, tpot: float, itl: float) -> dict:
    return {"median_ttft_ms": ttft, "median_tpot_ms": tpot, "median_itl_ms": itl}


def test_client_table_sets_the_two_clients_medians_side_by_side() -> None:
    measured = openai_serve.Server("minedraft", None, "http://127.0.0.1:1",
                                   rounds=[_round(100, 10, 20), _round(120, 12, 22), _round(80, 11, 30)],
                                   ours=[_round(105, 11, 19), _round(95, 10, 21), _round(300, 12, 20)])  # fmt: skip
    vllm_only = openai_serve.Server("vllm-sd", None, "http://127.0.0.1:2", rounds=[_round(1, 1, 1)])
    lines = openai_serve.client_table([measured, vllm_only]).splitlines()
    assert lines[0].startswith("| server | TTFT p50 ms: vLLM's / ours / ratio |")
    # medians: vLLM's 100, 11, 22; ours 105, 11, 20. A server measured by vLLM's client alone has no row.
    assert lines[2:] == ["| minedraft | 100.0 / 105.0 / 1.05 | 11.0 / 11.0 / 1.00 | 22.0 / 20.0 / 0.91 |"]


def _at_loads(*throughputs: tuple[float, ...]) -> dict[int, list[dict]]:
    """Rounds at loads 1 and 8: each tuple is one load's rounds of output tok/s."""
    return {load: [{"output_throughput": t} for t in rounds] for load, rounds in zip((1, 8), throughputs)}


def test_the_sweep_table_sets_each_server_beside_a_neighbour_against_itself_quiet_and_against_vllm_there() -> None:
    ours = openai_serve.Server("minedraft", None, "http://127.0.0.1:1", by_load=_at_loads((200, 210, 190), (800,)))
    vllm = openai_serve.Server("vllm-ar", None, "http://127.0.0.1:2", by_load=_at_loads((300,), (1000,)))
    ours_crowded, vllm_crowded = ours.beside_a_neighbour(), vllm.beside_a_neighbour()
    assert ours_crowded.crowded and ours_crowded.name == "minedraft+neighbour" and not ours.crowded
    ours_crowded.by_load, vllm_crowded.by_load = _at_loads((100,), (600,)), _at_loads((150,), (400,))
    lines = openai_serve.sweep_table([ours, vllm, ours_crowded, vllm_crowded]).splitlines()
    assert "| minedraft: neighbour / quiet | 0.50x | 0.75x |" in lines
    assert "| vllm-ar: neighbour / quiet | 0.50x | 0.40x |" in lines
    assert "| minedraft+neighbour / best peer there | 0.67x | 1.50x |" in lines
    assert "| minedraft / best peer | 0.67x | 0.80x |" in lines  # quiet: 200 / 300, 800 / 1000
    assert "| minedraft | - | - |" in lines  # the TPOT table, where no round measured one


def test_the_sweep_table_shows_each_servers_spread_over_its_starts_and_the_texts_equal_to_ar() -> None:
    starts = [openai_serve.Server(f"minedraft#{i}", None, "", by_load=_at_loads((t,), (4 * t,))) for i, t in
              enumerate((100, 95, 110), 1)]  # fmt: skip
    ar = openai_serve.Server("ar", None, "", by_load={1: [{"output_throughput": 90, "generated_texts": ["a", "b"]}]})
    llama = openai_serve.Server("llama-ar", None, "",
                                by_load={1: [{"output_throughput": 99, "generated_texts": ["a", "c"]}]})
    lines = openai_serve.sweep_table(starts).splitlines()
    # medians 100 and 400; the farthest start 110 (10%) and 440 (10%)
    assert "| minedraft: 3 starts, largest distance from their median | 10% of 100 | 10% of 400 |" in lines
    lines = openai_serve.sweep_table([ar, llama]).splitlines()
    assert "| llama-ar | 1/2 |" in lines and "| ar | 2/2 |" in lines
