"""The Grafana dashboard: valid JSON whose every query reads a series a live stack's /metrics exports, and the
chart's ConfigMap for Grafana's sidecar (off by default)."""

from __future__ import annotations

import json
import re
import urllib.request
from pathlib import Path

import kubernetes_validate
import pytest
from prometheus_client.parser import text_string_to_metric_families
from test_chart import renderer

from minedraft.bench.online import run_online_bench
from minedraft.stack.local import LocalStack, free_port, scheduler_settings

from conftest import tiny_config

ROOT = Path(__file__).resolve().parents[1]
DASHBOARD = ROOT / "charts" / "minedraft" / "dashboards" / "minedraft.json"
# Made by Prometheus for every target it scrapes, not by the target: the one series no /metrics exports.
PROMETHEUS_SERIES = {"up"}


def queries() -> list[str]:
    data = json.loads(DASHBOARD.read_text())
    return [t["expr"] for panel in data["panels"] for t in panel["targets"]]


def metric_names(expr: str) -> set[str]:
    """The series names of a PromQL expression: what is left once label lists (by, on, group_left),
    matchers {...}, ranges [...], functions and numbers are taken out."""
    text = re.sub(r"\b(by|on|without|group_left|group_right)\s*\([^)]*\)", " ", expr)
    text = re.sub(r"\{[^}]*\}|\[[^\]]*\]", " ", text)
    return set(re.findall(r"(?<![\w:.])[A-Za-z_:][\w:]*(?![\w:])(?!\s*\()", text))


def test_the_dashboard_is_valid_json_with_unique_panels() -> None:
    data = json.loads(DASHBOARD.read_text())
    assert data["uid"] == "minedraft" and data["title"] == "MineDraft"
    ids = [p["id"] for p in data["panels"]]
    assert len(ids) == len(set(ids)) >= 12
    titles = " ".join(p["title"] for p in data["panels"])
    for wanted in ("tokens / s", "TTFT", "TPOT", "accepted length", "per draft position", "running / waiting",
                   "KV cache", "Preemptions", "Worker idle", "health"):  # fmt: skip
        assert wanted in titles, wanted
    assert all(t["datasource"]["uid"] == "${datasource}" for p in data["panels"] for t in p["targets"])


def test_the_parser_finds_the_names() -> None:
    expr = 'sum by (instance, role) (rate(a:b_sum{job=~"$job"}[5m])) / scalar(sum(rate(c_total[1m]))) * on (x) up'
    assert metric_names(expr) == {"a:b_sum", "c_total", "up"}


@pytest.fixture(scope="module")
def exported(pair, tmp_path_factory) -> set[str]:
    """Sample names a small MineDraft stack exports after a few requests (adaptive k: every series appears)."""
    config = tiny_config(pair, {"num_speculative_tokens": 3, "is_parallel": True}, max_num_seqs=4)
    port = free_port()
    settings = scheduler_settings(metrics_port=port)
    with LocalStack(config, scheduler=settings, log_dir=tmp_path_factory.mktemp("logs")) as stack:
        result = run_online_bench(stack.address, [f"def f{i}(x):" for i in range(6)], concurrency=3, max_tokens=24,
                                  temperature=0.0, ignore_eos=True, progress=False)  # fmt: skip
        assert result.failed == 0, result.first_error
        text = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10).read().decode()
    return {s.name for family in text_string_to_metric_families(text) for s in family.samples}


def test_every_queried_series_is_exported(exported: set[str]) -> None:
    wanted = set().union(*(metric_names(q) for q in queries()))
    assert len(wanted) >= 15
    assert wanted - exported == PROMETHEUS_SERIES


def test_the_chart_renders_the_dashboard_for_grafanas_sidecar_when_asked() -> None:
    smoke = {"models": {"allowBundledOnGpus": True}}  # the GPU defaults refuse the bundled pair otherwise
    default = [m.obj for m in renderer.render(smoke)]
    assert not [o for o in default if o["metadata"]["name"].endswith("-dashboard")]
    values = {**smoke, "grafanaDashboard": {"enabled": True, "annotations": {"grafana_folder": "MineDraft"}}}
    (config_map,) = [m.obj for m in renderer.render(values) if m.obj["metadata"]["name"].endswith("-dashboard")]
    kubernetes_validate.validate(config_map, "1.35.0", strict=True)
    assert config_map["metadata"]["labels"]["grafana_dashboard"] == "1"
    assert config_map["metadata"]["annotations"] == {"grafana_folder": "MineDraft"}
    assert json.loads(config_map["data"]["minedraft.json"]) == json.loads(DASHBOARD.read_text())
