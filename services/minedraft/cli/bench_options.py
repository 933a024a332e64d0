"""`minedraft bench`'s options as pydantic models: each flag's name, help, default and bounds stated once.

The flags are generated from these models, one help group per model (`bench.add_bench_parser`);
`BenchOptions` combines them and checks the flags against one another.
"""

from __future__ import annotations

from typing import Literal

from pydantic import Field, field_validator, model_validator

from minedraft.bench import CHAOS_ROLES
from minedraft.cli.common import SamplingOptions
from minedraft.cli.flags import CliModel, as_flag

# Decoding modes of `minedraft bench` (minedraft.bench.offline.mode_configs; not imported here: torch).
MODE_NAMES = ("ar", "sd", "pearl", "minedraft", "minedraft+tetris", "sd+pard", "minedraft+pard", "sd+eagle3",
              "pearl+eagle3", "minedraft+eagle3", "sd+p-eagle", "minedraft+p-eagle")  # fmt: skip
OFFLINE_MODES = ",".join(MODE_NAMES[:5])
LAUNCH_MODES = "ar,sd,minedraft"


class BenchWay(CliModel):
    """What is benchmarked: exactly one of these (or the `compare` subcommand)."""

    offline: bool = Field(False, description="run the engine in this process, mode by mode")
    target: str | None = Field(None, description="benchmark the MineDraft gRPC server at this address",
                               json_schema_extra=as_flag(metavar="HOST:PORT"))  # fmt: skip
    base_url: str | None = Field(
        None, description="benchmark the OpenAI-compatible server at this URL (http://HOST:PORT)",
        json_schema_extra=as_flag(metavar="URL"),
    )  # fmt: skip
    launch: bool = Field(False, description="start a local stack per mode and benchmark each")
    k8s: bool = Field(False, description="benchmark a release in Kubernetes through a port-forward to its gateway")

    @field_validator("target")
    @classmethod
    def _host_port(cls, value: str | None) -> str | None:
        if value is not None and ":" not in value:
            raise ValueError("must be host:port")
        return value

    @field_validator("base_url")
    @classmethod
    def _url(cls, value: str | None) -> str | None:
        if value is not None and not value.startswith(("http://", "https://")):
            raise ValueError("must be an http:// or https:// URL")
        return value


class BenchRun(CliModel):
    """How the benchmark talks to the server, and which modes it compares how often."""

    backend: Literal["minedraft-grpc", "openai", "openai-chat"] | None = Field(
        None, description="how to talk to the server: minedraft-grpc (default with --target, --launch, --k8s), "
        "openai (/v1/completions, default with --base-url) or openai-chat (/v1/chat/completions)",
    )  # fmt: skip
    modes: str | None = Field(
        None, description=f"comma-separated modes to compare, of {','.join(MODE_NAMES)} (+pard: parallel drafting "
        "with the PARD draft; +eagle3: the EAGLE-3 head; +p-eagle: the head drafting in one pass); default: "
        f"{OFFLINE_MODES} with --offline, {LAUNCH_MODES} with --launch",
    )  # fmt: skip
    k: int | None = Field(
        None, ge=1, description="num_speculative_tokens of the speculative modes (default 4); a shorthand for "
        "--speculative-config's key, which it may not contradict",
    )  # fmt: skip
    repeats: int = Field(
        3, ge=1, description="--offline / --launch: interleaved rounds over all modes; each mode's median is reported"
    )


class K8sOptions(CliModel):
    """Where the release runs (--k8s)."""

    namespace: str = Field("default", description="namespace of the release")
    service: str = Field(
        "minedraft-gateway", description="the release's public Service: <release>-gateway (the chart's default), "
        "or <release>-scheduler where the gateway is off",
    )  # fmt: skip
    port_forward: Literal["kubectl", "client"] = Field(
        "kubectl", description="kubectl: `kubectl port-forward svc/...` as a subprocess; client: the kubernetes "
        "Python client",
    )  # fmt: skip


class DatasetOptions(CliModel):
    """The requests: a dataset's prompts, or random tokens."""

    dataset: str | None = Field(
        None, description="prompts: 'random' (random tokens of --input-len), a .jsonl of {prompt} or a ShareGPT "
        ".json; default: the bundled held-out code prompts",
    )  # fmt: skip
    num_prompts: int = Field(64, ge=1, description="use the first N prompts of the dataset")
    input_len: int = Field(128, ge=1, description="random: prompt tokens",
                           json_schema_extra=as_flag(aliases=("--random-input-len",)))  # fmt: skip
    output_len: int | None = Field(
        None, ge=1, description="random: tokens asked of each request (its max_tokens; add --ignore-eos to get them "
        "all); default: --max-tokens", json_schema_extra=as_flag(aliases=("--random-output-len",)),
    )  # fmt: skip
    random_range_ratio: float = Field(
        0.0, ge=0, lt=1, description="random: lengths drawn uniformly from [len * (1 - r), len * (1 + r)]"
    )


class LoadOptions(CliModel):
    """How the requests arrive at a running server."""

    concurrency: int = Field(16, ge=1, description="most requests in flight at once",
                             json_schema_extra=as_flag(aliases=("--max-concurrency",)))  # fmt: skip
    request_rate: float | None = Field(
        None, gt=0, description="requests per second, arriving as a gamma process of shape --burstiness (still "
        "capped by --concurrency); default: send as fast as the concurrency allows",
    )  # fmt: skip
    burstiness: float = Field(
        1.0, gt=0, description="shape of the arrival gaps' gamma distribution: 1 = Poisson, below 1 burstier, "
        "above 1 more even",
    )  # fmt: skip
    ramp_up_strategy: Literal["linear", "exponential"] | None = Field(
        None, description="let the request rate move from --ramp-up-start-rps to --ramp-up-end-rps over the run"
    )
    ramp_up_start_rps: float | None = Field(None, gt=0, description="ramp-up: the first rate (req/s)")
    ramp_up_end_rps: float | None = Field(None, gt=0, description="ramp-up: the last rate (req/s)")
    sweep_concurrency: str | None = Field(
        None, description="--target / --base-url: one run per concurrency (e.g. 1,4,16,32,64); --plot adds tok/s "
        "and TTFT against concurrency", json_schema_extra=as_flag(metavar="C1,C2,..."),
    )  # fmt: skip
    timeout: float = Field(600.0, gt=0, description="per-request deadline in seconds")
    progress_interval: float = Field(
        5.0, gt=0, description="seconds between progress lines when stdout is not a terminal (on a terminal: a "
        "progress bar)",
    )  # fmt: skip
    warmup: int = Field(2, ge=0, description="requests sent (and not measured) before the run, per server")
    served_model_name: str | None = Field(
        None, description="OpenAI backends: the model to ask for; default: the first one the server's /v1/models "
        "lists",
    )  # fmt: skip
    bench_api_key: str | None = Field(None, description="OpenAI backends: bearer token; default: $OPENAI_API_KEY",
                                      json_schema_extra=as_flag(flag="--api-key", metavar="KEY"))  # fmt: skip

    @field_validator("sweep_concurrency")
    @classmethod
    def _sweep(cls, value: str | None) -> str | None:
        if value is not None and not _concurrencies(value):
            raise ValueError("wants integers >= 1 like 1,4,16")
        return value

    @property
    def sweep(self) -> list[int]:
        """--sweep-concurrency 1,4,16 -> [1, 4, 16]; [] when not given."""
        return _concurrencies(self.sweep_concurrency) if self.sweep_concurrency else []


def _concurrencies(text: str) -> list[int]:
    try:
        values = [int(c) for c in text.split(",")]
    except ValueError:
        return []
    return values if all(c >= 1 for c in values) else []


class ReportOptions(CliModel):
    """What the benchmark reports, and where it writes it."""

    percentiles: str = Field(
        "99", description="comma-separated percentiles of TTFT, TPOT, ITL and E2EL to report, e.g. 50,90,99",
        json_schema_extra=as_flag(aliases=("--metric-percentiles",)),
    )  # fmt: skip
    slo: list[str] | None = Field(
        None, description="limits for goodput (requests per second meeting all of them), e.g. ttft:200,tpot:50; "
        "keys ttft, tpot, e2el, in milliseconds", json_schema_extra=as_flag(aliases=("--goodput",), metavar="KEY:MS"),
    )  # fmt: skip
    metrics_url: str | None = Field(
        None, description="--target / --base-url: a MineDraft scheduler's Prometheus endpoint (e.g. "
        "http://127.0.0.1:7450/metrics), scraped before and after the run for step times, overhead and overlap",
    )  # fmt: skip
    json_file: str | None = Field(
        None, description="also write the figures as JSON (vLLM's keys: mean_ttft_ms, ...)",
        json_schema_extra=as_flag(flag="--json", metavar="FILE"),
    )  # fmt: skip
    trace: str | None = Field(
        None, description="write one line per request: when it was sent, TTFT, E2EL, every chunk's time and tokens, "
        "accepted drafts", json_schema_extra=as_flag(metavar="FILE.jsonl"),
    )  # fmt: skip
    plot: str | None = Field(
        None, description="draw throughput, latency percentiles and acceptance per draft position (needs "
        "matplotlib: the `bench` extra)", json_schema_extra=as_flag(metavar="FILE.png"),
    )  # fmt: skip
    draft_model: str | None = Field(
        None, description="--launch: draft checkpoint of the speculative modes; default: bundled"
    )
    log_dir: str | None = Field(None, description="--launch: service logs; default: a new temporary folder")
    log_level: str = Field("INFO", description="--launch: the services' log level")


class ChaosOptions(CliModel):
    """`bench --chaos`: kill the services of a local `minedraft up` under load."""

    chaos: bool = Field(
        False, description="SIGKILL the services of the `minedraft up` serving --target, one at a time, under load "
        "through the client SDK (retries and resumption on; greedy, or with --temperature above 0 sampled with each "
        "prompt's index as its seed); report requests lost, outputs changed against an undisturbed first pass, and "
        "time to heal",
    )  # fmt: skip
    chaos_interval: float = Field(20.0, gt=0, description="seconds between kills")
    chaos_duration: float = Field(60.0, gt=0, description="seconds of the chaos pass")
    chaos_targets: str = Field(",".join(CHAOS_ROLES), description="the roles killed in turn (each group's in turn)")

    @field_validator("chaos_targets")
    @classmethod
    def _roles(cls, value: str) -> str:
        if not set(value.split(",")) <= set(CHAOS_ROLES):
            raise ValueError(f"roles of {','.join(CHAOS_ROLES)}")
        return value


BENCH_GROUPS: tuple[tuple[type[CliModel], str], ...] = (
    (K8sOptions, "kubernetes (--k8s)"),
    (DatasetOptions, "dataset"),
    (LoadOptions, "online (--target, --base-url, --launch, --k8s)"),
    (ReportOptions, "online (--target, --base-url, --launch, --k8s)"),
    (ChaosOptions, "chaos (--chaos --target HOST:PORT of a `minedraft up` on this machine)"),
)


class BenchOptions(BenchWay, BenchRun, K8sOptions, DatasetOptions, LoadOptions, ReportOptions, ChaosOptions,
                   SamplingOptions):  # fmt: skip
    """Every `minedraft bench` flag but the engine's: bounds per flag (above), and how flags go together."""

    @property
    def backend_name(self) -> str:
        return self.backend or ("openai" if self.base_url else "minedraft-grpc")

    @property
    def server(self) -> str | None:
        return self.target or self.base_url

    @model_validator(mode="after")
    def _together(self) -> BenchOptions:
        for ok, message in self._rules():
            if not ok:
                raise ValueError(message)
        return self

    def _rules(self) -> list[tuple[bool, str]]:
        backend, server, ramp = self.backend_name, self.server, self.ramp_up_strategy
        ways = [self.offline, bool(self.target), bool(self.base_url), self.launch, self.k8s]
        return [
            (sum(ways) == 1, "give one of --offline, --target, --base-url, --launch, --k8s (or `bench compare A B`)"),
            (backend == "minedraft-grpc" or self.base_url, f"--backend {backend} needs --base-url http://HOST:PORT"),
            (backend != "minedraft-grpc" or not self.base_url, "--base-url is for --backend openai or openai-chat; "
             "a MineDraft gRPC server is --target HOST:PORT"),
            ((ramp is None) == (self.ramp_up_start_rps is None) == (self.ramp_up_end_rps is None),
             "--ramp-up-strategy goes with --ramp-up-start-rps and --ramp-up-end-rps"),
            (ramp is None or self.request_rate is None, "--ramp-up-* sets the rate: no --request-rate"),
            (self.metrics_url is None or server or self.k8s, "--metrics-url goes with --target, --base-url or "
             "--k8s (--launch scrapes each stack it starts)"),
            (not self.sweep_concurrency or server or self.k8s, "--sweep-concurrency goes with --target, --base-url "
             "or --k8s"),
            (not self.offline or not (self.json_file or self.trace or self.plot), "--json, --trace and --plot are "
             "for the online benchmarks"),
            (self.draft_model is None or self.launch, "--draft-model goes with --launch"),
            (not self.chaos or self.target, "--chaos needs --target HOST:PORT, a `minedraft up` on this machine (it "
             "kills up's services by pid; not --offline, --base-url, --launch or --k8s)"),
        ]  # fmt: skip
