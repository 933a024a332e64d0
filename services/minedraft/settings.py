"""Service settings: one pydantic model per service role, as `EngineConfig` is for the engine.

Each model is the one place of its options' names, help, bounds and defaults: the CLI generates a flag
per field (`--http-port`, env MINEDRAFT_HTTP_PORT) plus one flag for the whole model as JSON
(`--scheduler-settings`, env MINEDRAFT_SCHEDULER_SETTINGS), and a launcher hands each child process its
models as that JSON. Addresses that wire one process to another (listen host and port, the workers'
addresses, the gateway's backends) and secrets (API keys) are not settings: they stay per-process flags.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, ClassVar, Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

if TYPE_CHECKING:
    from minedraft.config import EngineConfig

# The gateway's own API key toward the schedulers (a secret: from the environment or a file, never a setting).
BACKEND_API_KEY_ENV = "MINEDRAFT_BACKEND_API_KEY"

# Room in a gRPC message beyond the prompt's own bytes: sampling fields, stop strings, the request id.
MESSAGE_HEADROOM_BYTES = 64 * 1024


class ListenError(OSError):
    """A service cannot listen where its settings say (the port is taken, or not allowed): the CLI prints
    this one line, naming the flag, and exits 2."""

    def __init__(self, flag: str, address: str, reason: str = "the port is in use or not allowed") -> None:
        super().__init__(f"cannot listen on {address} ({flag}): {reason}")


class StartupError(RuntimeError):
    """A service of a local stack exited before the stack served (it printed its own reason)."""


class ServiceSettings(BaseModel):
    """What the settings models share: unknown keys are errors, and how the CLI names the whole model."""

    model_config = ConfigDict(extra="forbid")

    # the flag (and MINEDRAFT_<NAME> variable) that takes the whole model as JSON
    json_name: ClassVar[str]
    # old field name -> new one: the old spelling still works, with a warning, for one release
    deprecated_names: ClassVar[dict[str, str]] = {}


class PublicApiSettings(ServiceSettings):
    """What a service facing clients has (the scheduler, and the gateway in front of several): the HTTP port,
    TLS on both public listeners, the served name and the input limits."""

    http_port: int = Field(0, ge=0, le=65535, description="OpenAI-compatible HTTP API (and /metrics) port; 0 = off.")
    served_model_name: str | None = Field(
        None, description="Model name of the HTTP API and the metrics; none: the target's folder name."
    )
    tls_cert: str | None = Field(
        None, description="PEM certificate (chain) of both public listeners; with tls_key: TLS on."
    )
    tls_key: str | None = Field(None, description="PEM private key of tls_cert.")
    max_prompt_bytes: int = Field(  # 1 MiB: ~250k tokens of English text, beyond any context we serve
        1024 * 1024, ge=1, description="Longer prompts are refused before tokenizing; also bounds "
        "request sizes.",
    )  # fmt: skip
    max_waiting_requests: int = Field(256, ge=0, description="Queued requests beyond this get RESOURCE_EXHAUSTED.")
    per_request_spec_decode_metrics: Literal["summary", "detailed"] | None = Field(
        None, description="HTTP responses (and a stream's final chunk) carry the request's speculative decoding "
        "counts as `metrics.speculative_decoding`: summary (drafts, draft and accepted tokens, mean acceptance "
        "length) or detailed (also the accepted count per draft position); none: off.",
    )  # fmt: skip

    @model_validator(mode="after")
    def _check_tls(self) -> PublicApiSettings:
        if bool(self.tls_cert) != bool(self.tls_key):
            raise ValueError("TLS needs both --tls-cert and --tls-key")
        return self

    @property
    def max_request_bytes(self) -> int:
        return self.max_prompt_bytes + MESSAGE_HEADROOM_BYTES


class SchedulerSettings(PublicApiSettings):
    """The scheduler: its public APIs (HTTP port, TLS, served name, input limits), metrics, and how it
    waits for its workers, re-forms their world and drains its requests."""

    json_name = "scheduler_settings"
    deprecated_names = {"drain_timeout": "request_drain_timeout"}

    metrics_port: int = Field(
        7450, ge=0, le=65535, description="Prometheus port; 0 = off. (Not 9090: that is the Prometheus server's own.)"
    )
    startup_timeout: float = Field(1800.0, gt=0, description="Seconds to wait for the workers to load.")
    worker_wait: float = Field(
        300.0, ge=0, description="Seconds to hold requests while no verifier serves (it died and is restarting); "
        "then they fail with UNAVAILABLE.",
    )  # fmt: skip
    join_timeout: float = Field(180.0, gt=0, description="Seconds the workers may take to form a new world.")
    seeded_drafter_wait: float = Field(
        60.0, ge=0, description="Seconds a seeded sampled request waits for a drafter while its group decodes "
        "target-only (its drafter died): where its windows fall decides its text, so waiting keeps the text a run "
        "with a drafter gives; past this wait it decodes target-only (still a sample of the target's distribution, "
        "another one). 0 = never wait.",
    )  # fmt: skip
    request_drain_timeout: float = Field(
        30.0, ge=0, description="On SIGTERM: stop admitting (NOT_SERVING, new requests get UNAVAILABLE) and give "
        "the running requests this many seconds to finish; the rest then get UNAVAILABLE.",
    )  # fmt: skip
    step_deadline_floor: float = Field(
        60.0, gt=0, description="A step that takes longer than max(this, 10 x the 99th percentile of recent steps) "
        "counts as a hung worker: the scheduler re-forms the world without it.",
    )  # fmt: skip
    log_stats_interval: float = Field(
        10.0, ge=0, description="Seconds between the scheduler's stats log lines while requests run (generation "
        "throughput, running and waiting requests, KV usage, draft acceptance, worker idle); 0 = none.",
    )  # fmt: skip
    max_steps_in_flight: int = Field(
        2, ge=1, le=2, description="Steps sent to the workers ahead of their results: 2 = the next plan travels while "
        "a step runs (no round trip between steps); 1 = wait for each step's results before planning the next.",
    )  # fmt: skip


class WorkerSettings(ServiceSettings):
    """A drafter or verifier: how long it waits for a hung peer, and for the scheduler when it stops."""

    json_name = "worker_settings"
    deprecated_names = {"drain_timeout": "step_drain_timeout"}

    dist_timeout: float = Field(
        120.0, gt=0, description="Seconds a collective waits for a peer; a hung peer is given up after this "
        "(forming a world too).",
    )  # fmt: skip
    step_drain_timeout: float = Field(
        30.0, ge=0, description="On SIGTERM: wait up to this many seconds for the scheduler to stop sending steps "
        "(it drains its requests first), then stop.",
    )  # fmt: skip
    cpu_threads_beside: int = Field(
        0, ge=0, le=4096, description="On CPU: intra-op threads of a step part that runs while the other worker "
        "computes too, when both share one machine's cores (a part that runs alone uses every thread the process "
        "has); 0 = as many as alone. `minedraft up` sets it to the worker's share.",
    )  # fmt: skip
    colocate_drafter: bool | None = Field(
        None, description="The verifier runs the draft model too, in its own process, and no drafter service "
        "runs (tensor_parallel_size 1): no step-end exchange between two processes, which on one machine's CPU "
        "is most of a small step's cost. A drafter that dies then takes the verifier with it. Unset: `minedraft "
        "up` colocates on CPU at tensor_parallel_size 1 (the drafter has no compute of its own there) and runs a "
        "drafter service elsewhere; a verifier started on its own (a pod) does not colocate.",
    )  # fmt: skip


class GatewaySettings(PublicApiSettings):
    """The gateway: the public APIs as a scheduler serves them, how it reaches the engine groups' schedulers,
    and how long a request may wait for one. (Its own credential toward them is a secret: a flag, not a
    setting.)"""

    json_name = "gateway_settings"

    placement_timeout: float = Field(
        60.0, gt=0, description="Seconds a request without a deadline may wait for a serving engine group; then "
        "UNAVAILABLE.",
    )  # fmt: skip
    routing_policy: Literal["least-work", "prefix", "predicted"] = Field(
        "least-work", description="How a request picks its engine group: least-work (fewest requests, then tokens "
        "owed), prefix (the group that holds the longest cached prefix of the prompt, or an x-session-id's "
        "group, unless it is overloaded), predicted (the earliest predicted completion from each group's "
        "measured speed, queue and cached prefix).",
    )  # fmt: skip
    backend_tls_ca: str | None = Field(
        None, description="PEM certificates the gateway trusts for the schedulers' TLS (their issuer, or their "
        "own self-signed certificate); set: the gateway reaches them over TLS.",
    )  # fmt: skip
    backend_tls_server_name: str | None = Field(
        None, description="Name the schedulers' certificate must carry, when they are reached by IP address "
        "(as discovered from EndpointSlices); none: the address itself.",
    )  # fmt: skip


class SupervisorSettings(ServiceSettings):
    """`minedraft up` as the kubelet of its services: how it restarts one that exits, and when it gives up."""

    json_name = "supervisor_settings"

    restart_backoff_max: float = Field(
        10.0, gt=0, description="A service that exits is started again after 1 s, doubled for each restart within "
        "--crash-loop-window, at most this many seconds.",
    )  # fmt: skip
    crash_loop_restarts: int = Field(
        5, ge=0, description="A service that exits again after this many restarts within --crash-loop-window "
        "crash-loops: up names it and stops with status 1.",
    )  # fmt: skip
    crash_loop_window: float = Field(
        120.0, gt=0, description="Seconds over which restarts count toward --crash-loop-restarts (and the back-off).",
    )
    log_dir: str | None = Field(
        None, description="Folder of each service's log (<service>.log; group-<i>/ with engine groups); none: "
        "every service logs to this terminal.",
    )  # fmt: skip


SETTINGS_MODELS: tuple[type[ServiceSettings], ...] = (
    SchedulerSettings, WorkerSettings, GatewaySettings, SupervisorSettings,
)  # fmt: skip


def settings_flags(*settings: ServiceSettings) -> list[str]:
    """The flags that give a child process these settings whole, one JSON per model."""
    flags = []
    for model in settings:
        flags += ["--" + model.json_name.replace("_", "-"), model.model_dump_json()]
    return flags


def served_model_name(config: EngineConfig, settings: PublicApiSettings) -> str:
    """The model name the public APIs serve: --served-model-name, else the hub id the model was given as,
    else the target checkpoint's folder name."""
    from minedraft.model.hub import is_hub_id

    if settings.served_model_name:
        return settings.served_model_name
    return config.model if config.model and is_hub_id(config.model) else config.target_path.name
