"""The Helm chart (charts/minedraft): rendered with the Helm v4 library, linted, every object validated
against the Kubernetes schemas, and the invariants a GPU deployment depends on checked per combination."""

from __future__ import annotations

import functools
import importlib.util
import json
import os
import sys
import typing
from pathlib import Path
from typing import Any

import helm_python as helm
import kubernetes_validate
import pytest
import yaml

from minedraft.cli import build_parser
from minedraft.cli.common import engine_config as parsed_engine_config
from minedraft.cli.common import settings
from minedraft.cli.serve import dist_config
from minedraft.config import EngineConfig, SpeculativeConfig
from minedraft.settings import SchedulerSettings, WorkerSettings

ROOT = Path(__file__).resolve().parents[1]
CHART = ROOT / "charts" / "minedraft"
KUBE_VERSION = "1.35.0"  # validated strictly (unknown fields are errors) against this release's schemas
TOKEN = "hf_MineDraftChartTestToken0123456789"  # recognisable: must never appear in rendered text


def _load_renderer():
    spec = importlib.util.spec_from_file_location("render_manifests", ROOT / "scripts" / "render_manifests.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules["render_manifests"] = module  # dataclasses look their module up while the class is built
    spec.loader.exec_module(module)
    return module


renderer = _load_renderer()
CPU = renderer.profile_values("cpu")
GPU_EXAMPLE = renderer.profile_values("gpu")
CLAIM_MODELS = {"target": "llama-3-8b", "draft": "llama-3-draft"}


def gpu_ok(values: dict[str, Any]) -> dict[str, Any]:
    """`values` with the bundled pair allowed on GPUs: these tests render the chart's structure with it (the
    refusal itself is tested below)."""
    return renderer.merge({"models": {"allowBundledOnGpus": True}}, values)
COMBINATIONS: dict[str, dict[str, Any]] = {
    "default": {},
    "cpu": CPU,
    "tp1": {"verifier": {"tensorParallelSize": 1}},
    "tp2": {"verifier": {"tensorParallelSize": 2}},
    "tp8": {"verifier": {"tensorParallelSize": 8}},
    "host-ipc": {"distributed": {"hostIPC": True}},
    "existing-claim": {"models": {**CLAIM_MODELS, "volume": {"type": "existingClaim", "existingClaim": "llm-models"}}},
    "created-claim-download": {
        "models": {
            **CLAIM_MODELS,
            "volume": {"type": "createClaim", "size": "500Gi", "storageClassName": "fast"},
            "download": {"enabled": True, "target": "org/target", "draft": "org/draft", "revision": "v1"},
        },
        "hfToken": {"existingSecret": "hf-token", "key": "token"},
    },
    "empty-dir-download": {
        "models": {
            **CLAIM_MODELS,
            "volume": {"type": "emptyDir"},
            "download": {"enabled": True, "target": "org/target", "draft": "org/draft"},
        },
        "hfToken": {"existingSecret": "hf-token"},
    },
    "extras": {
        "serviceMonitor": {"enabled": True, "labels": {"release": "prometheus"}},
        "podDisruptionBudget": {"enabled": True},
        "networkPolicy": {
            "enabled": True,
            "clientFrom": [{"namespaceSelector": {"matchLabels": {"team": "apps"}}}],
        },
    },
    "extras-autoregressive": {
        "speculativeConfig": None,
        "serviceMonitor": {"enabled": True},
        "podDisruptionBudget": {"enabled": True},
        "networkPolicy": {"enabled": True},
    },
    "tetris": {"speculativeConfig": {"tetris": True, "tetris_capacity": 48, "num_speculative_tokens": 3},
               "scheduler": {"perRequestSpecDecodeMetrics": "detailed"}},
    "tls-keys": {
        "apiKeys": {"existingSecret": "minedraft-api-keys"},
        "tls": {"existingSecret": "minedraft-tls"},
        "scheduler": {"servedModelName": "llama-3-8b", "httpPort": 8443},
    },
    "lora-claim": {
        "engine": {"enableLora": True, "maxLoras": 2, "loraModules": [
            {"name": "sql", "path": "sql", "draftPath": "sql-draft"}, {"name": "chat", "path": "chat"}]},
        "loraAdapters": {"volume": {"type": "existingClaim", "existingClaim": "adapters"}},
    },
    "lora-download": {
        "engine": {"enableLora": True, "loraModules": [
            {"name": "sql", "path": "sql", "draftPath": "sql-draft", "repo": "org/sql", "draftRepo": "org/sql-draft"}]},
        "loraAdapters": {"volume": {"type": "emptyDir"}, "download": {"enabled": True, "revision": "v2"}},
        "hfToken": {"existingSecret": "hf-token"},
    },
    "cert-manager": {"tls": {"certManager": {"enabled": True, "issuerRef": {"name": "ca", "kind": "ClusterIssuer"},
                                             "dnsNames": ["llm.example.com"]}}},
    "no-http-no-policy": {"scheduler": {"httpPort": 0}, "networkPolicy": {"enabled": False}},
    "per-component-scheduling": {
        "scheduler": {"nodeSelector": {"pool": "cpu"}, "tolerations": [{"key": "cpu-only", "operator": "Exists"}]},
        "verifier": {
            "nodeSelector": {"gpu": "h100"},
            "tolerations": [{"key": "big-gpu", "operator": "Exists", "effect": "NoSchedule"}],
            "runtimeClassName": "nvidia",
            "affinity": {"nodeAffinity": {"requiredDuringSchedulingIgnoredDuringExecution": {"nodeSelectorTerms": [
                {"matchExpressions": [{"key": "zone", "operator": "In", "values": ["a"]}]}
            ]}}},
        },
        "drafter": {
            "nodeSelector": {"gpu": "h100", "drafter": "ok"},
            "tolerations": [{"key": "small-gpu", "operator": "Exists", "effect": "NoSchedule"}],
            "runtimeClassName": "nvidia-mig",
            "gpuResourceName": "nvidia.com/mig-3g.40gb",
            "affinity": {"podAntiAffinity": {"preferredDuringSchedulingIgnoredDuringExecution": [
                {"weight": 10, "podAffinityTerm": {"topologyKey": "kubernetes.io/hostname",
                                                   "labelSelector": {"matchLabels": {"noisy": "true"}}}}
            ]}},
        },
    },
}  # fmt: skip


@functools.cache
def _render(name: str) -> tuple[dict[str, Any], ...]:
    return tuple(m.obj for m in renderer.render(gpu_ok(COMBINATIONS[name])))


def render(name: str) -> list[dict[str, Any]]:
    return json.loads(json.dumps(_render(name)))  # a private copy: tests may not mutate the cache


def find(objs: list[dict], kind: str, suffix: str = "") -> list[dict]:
    return [o for o in objs if o["kind"] == kind and o["metadata"]["name"].endswith(suffix)]


def one(objs: list[dict], kind: str, suffix: str = "") -> dict:
    found = find(objs, kind, suffix)
    assert len(found) == 1, f"expected one {kind} *{suffix}, got {[o['metadata']['name'] for o in found]}"
    return found[0]


def pod(objs: list[dict], component: str) -> dict:
    return one(objs, "Deployment", f"-{component}")["spec"]["template"]["spec"]


def engine_config(objs: list[dict]) -> dict[str, Any]:
    """The engine config every service of the group starts with."""
    return json.loads(configmap(objs)["MINEDRAFT_ENGINE_CONFIG"])


def configmap(objs: list[dict]) -> dict[str, str]:
    return one(objs, "ConfigMap")["data"]


# --- rendering, lint, Kubernetes schemas -----------------------------------------------------------------


@pytest.mark.parametrize("values", [gpu_ok({}), CPU, GPU_EXAMPLE], ids=["default", "cpu", "gpu-example"])
def test_lint_is_clean(values) -> None:
    report = helm.lint(renderer.CHART_DIR, values=values, strict=True, kube_version=f"v{KUBE_VERSION}")
    problems = [m for m in report["messages"] if m["severity"] >= 2] + report["errors"]
    assert not problems, problems


@pytest.mark.parametrize("name", sorted(COMBINATIONS))
def test_every_object_validates(name: str) -> None:
    for obj in render(name):
        if obj["kind"] == "ServiceMonitor":  # a CRD: no schema in kubernetes-validate
            _check_service_monitor(obj, render(name))
            continue
        if obj["kind"] == "Certificate":  # cert-manager's CRD: no schema in kubernetes-validate either
            _check_certificate(obj, render(name))
            continue
        try:
            kubernetes_validate.validate(obj, KUBE_VERSION, strict=True)
        except kubernetes_validate.ValidationError as exc:
            pytest.fail(f"{obj['kind']} {obj['metadata']['name']}: {exc.message}")


def _check_service_monitor(monitor: dict, objs: list[dict]) -> None:
    assert monitor["apiVersion"] == "monitoring.coreos.com/v1"
    service = one(objs, "Service", "-scheduler")
    assert monitor["spec"]["selector"]["matchLabels"].items() <= service["metadata"]["labels"].items()
    port_names = {p["name"] for p in service["spec"]["ports"]}
    assert all(e["port"] in port_names for e in monitor["spec"]["endpoints"])


def _check_certificate(certificate: dict, objs: list[dict]) -> None:
    assert certificate["apiVersion"] == "cert-manager.io/v1"
    assert set(certificate["spec"]) == {"secretName", "dnsNames", "issuerRef"}
    volumes = {v["name"]: v for v in pod(objs, "scheduler")["volumes"]}
    assert volumes["tls"]["secret"]["secretName"] == certificate["spec"]["secretName"]
    assert set(certificate["spec"]["issuerRef"]) == {"name", "kind", "group"}


def test_templates_never_read_the_environment(monkeypatch) -> None:
    """A token exported in the shell that renders the chart cannot leak into the manifests."""
    monkeypatch.setenv("HF_TOKEN", TOKEN)
    for name in ("default", "created-claim-download"):
        text = renderer.to_yaml(renderer.render(gpu_ok(COMBINATIONS[name])), name)
        assert TOKEN not in text


# --- GPUs and scheduling -----------------------------------------------------------------------------------


def _gpus(pod_spec: dict, resource: str = "nvidia.com/gpu") -> Any:
    return pod_spec["containers"][0]["resources"].get("limits", {}).get(resource)


@pytest.mark.parametrize(("name", "tp"), [("tp1", 1), ("tp2", 2), ("default", 4), ("tp8", 8)])
def test_gpu_counts(name: str, tp: int) -> None:
    objs = render(name)
    assert _gpus(pod(objs, "verifier")) == tp
    assert _gpus(pod(objs, "drafter")) == 1
    assert _gpus(pod(objs, "scheduler")) is None
    assert engine_config(objs)["tensor_parallel_size"] == tp


def test_cpu_profile_requests_no_gpu_and_avoids_gpu_nodes() -> None:
    objs = render("cpu")
    text = json.dumps(objs)
    # (gpu_memory_utilization is an engine setting that a CPU engine ignores, not a GPU request)
    unrelated = text.lower().replace("minedraft/pool", "").replace("gpu_memory_utilization", "")
    assert "nvidia" not in text and "gpu" not in unrelated
    for component in ("scheduler", "verifier", "drafter"):
        spec = pod(objs, component)
        assert spec["nodeSelector"] == {"minedraft/pool": "cpu"}
        assert not spec.get("tolerations")
        assert "limits" not in spec["containers"][0]["resources"] or all(
            "gpu" not in key for key in spec["containers"][0]["resources"]["limits"]
        )
    data = configmap(objs)
    engine = engine_config(objs)
    assert (engine["device"], data["MINEDRAFT_DIST_BACKEND"]) == ("cpu", "gloo")
    assert engine["model"] is None and "model" not in engine["speculative_config"]


def test_default_gpu_placement() -> None:
    objs = render("default")
    for component in ("verifier", "drafter"):
        spec = pod(objs, component)
        assert spec["nodeSelector"] == {"nvidia.com/gpu.present": "true"}
        assert {"key": "nvidia.com/gpu", "operator": "Exists", "effect": "NoSchedule"} in spec["tolerations"]
    assert "nodeSelector" not in pod(objs, "scheduler") and "tolerations" not in pod(objs, "scheduler")


def test_scheduling_values_land_on_their_own_component() -> None:
    objs = render("per-component-scheduling")
    values = COMBINATIONS["per-component-scheduling"]
    for component in ("scheduler", "verifier", "drafter"):
        spec = pod(objs, component)
        expected_selector = dict(values[component]["nodeSelector"])
        if component != "scheduler":  # user keys are merged with the default GPU label
            expected_selector["nvidia.com/gpu.present"] = "true"
        assert spec["nodeSelector"] == expected_selector
        assert spec["tolerations"] == values[component]["tolerations"]
        assert spec.get("runtimeClassName") == values[component].get("runtimeClassName")
    assert _gpus(pod(objs, "drafter"), "nvidia.com/mig-3g.40gb") == 1
    assert _gpus(pod(objs, "verifier")) == 4
    verifier = pod(objs, "verifier")
    assert verifier["affinity"] == values["verifier"]["affinity"]


@pytest.mark.parametrize("name", ["default", "cpu", "per-component-scheduling"])
def test_drafter_is_pinned_to_the_verifier_node(name: str) -> None:
    objs = render(name)
    verifier_labels = one(objs, "Deployment", "-verifier")["spec"]["template"]["metadata"]["labels"]
    affinity = pod(objs, "drafter")["affinity"]
    terms = affinity["podAffinity"]["requiredDuringSchedulingIgnoredDuringExecution"]
    pinned = [
        t
        for t in terms
        if t["topologyKey"] == "kubernetes.io/hostname"
        and t["labelSelector"]["matchLabels"].items() <= verifier_labels.items()
    ]
    assert len(pinned) == 1
    assert pinned[0]["labelSelector"]["matchLabels"]["app.kubernetes.io/component"] == "verifier"
    if name == "per-component-scheduling":  # the user's own affinity survives next to the pin
        assert affinity["podAntiAffinity"] == COMBINATIONS[name]["drafter"]["affinity"]["podAntiAffinity"]


@pytest.mark.parametrize("name", sorted(COMBINATIONS))
def test_gpu_workloads_are_recreated_not_rolled(name: str) -> None:
    for deployment in find(render(name), "Deployment"):
        if deployment["metadata"]["name"].endswith("-gateway"):  # no GPU, stateless: rolled (test_chart_gateway)
            continue
        assert deployment["spec"]["strategy"] == {"type": "Recreate"}, deployment["metadata"]["name"]
        assert deployment["spec"]["replicas"] == 1


# --- probes, shared memory, security -------------------------------------------------------------------------


@pytest.mark.parametrize("name", ["default", "cpu", "no-http-no-policy"])
def test_probes_are_grpc_with_a_long_startup_budget(name: str) -> None:
    objs = render(name)
    for deployment in find(objs, "Deployment"):
        container = deployment["spec"]["template"]["spec"]["containers"][0]
        ports = {p["containerPort"] for p in container["ports"]}
        for kind in ("startupProbe", "readinessProbe", "livenessProbe"):
            probe = container[kind]
            assert set(probe) & {"httpGet", "exec", "tcpSocket"} == set()
            assert probe["grpc"]["service"] == "" and probe["grpc"]["port"] in ports
        startup = container["startupProbe"]
        budget = startup["periodSeconds"] * startup["failureThreshold"]
        assert budget >= (3600 if name == "default" else 600)
        # Liveness could only kill a pod that already started; its own window stays short of the budget.
        liveness = container["livenessProbe"]
        assert liveness["periodSeconds"] * liveness["failureThreshold"] < budget
    assert configmap(objs)["MINEDRAFT_STARTUP_TIMEOUT"] == str(budget)  # the scheduler waits as long


def test_startup_budget_is_configurable() -> None:
    values = gpu_ok({"probes": {"startup": {"periodSeconds": 30, "failureThreshold": 240}}})
    objs = [m.obj for m in renderer.render(values)]
    probe = pod(objs, "verifier")["containers"][0]["startupProbe"]
    assert probe["periodSeconds"] * probe["failureThreshold"] == 7200
    assert configmap(objs)["MINEDRAFT_STARTUP_TIMEOUT"] == "7200"


@pytest.mark.parametrize("name", ["default", "cpu", "tp8"])
def test_dev_shm_is_memory_backed(name: str) -> None:
    objs = render(name)
    for component in ("verifier", "drafter"):
        spec = pod(objs, component)
        mounts = {m["mountPath"]: m["name"] for m in spec["containers"][0]["volumeMounts"]}
        volume = next(v for v in spec["volumes"] if v["name"] == mounts["/dev/shm"])
        assert volume["emptyDir"]["medium"] == "Memory" and volume["emptyDir"]["sizeLimit"]
        assert not spec.get("hostIPC")


def test_host_ipc_uses_the_node_dev_shm() -> None:
    objs = render("host-ipc")
    for component in ("verifier", "drafter"):
        spec = pod(objs, component)
        assert spec["hostIPC"] is True
        # Mounting an emptyDir over /dev/shm would hide the node's, which hostIPC is there to share.
        assert "/dev/shm" not in {m["mountPath"] for m in spec["containers"][0]["volumeMounts"]}
    assert not pod(objs, "scheduler").get("hostIPC")


@pytest.mark.parametrize("name", ["default", "cpu", "created-claim-download"])
def test_security_context(name: str) -> None:
    for deployment in find(render(name), "Deployment"):
        spec = deployment["spec"]["template"]["spec"]
        assert spec["securityContext"]["runAsNonRoot"] is True
        # only the gateway calls the Kubernetes API (it watches EndpointSlices)
        assert spec["automountServiceAccountToken"] is deployment["metadata"]["name"].endswith("-gateway")
        assert spec["enableServiceLinks"] is False  # no MINEDRAFT_<SERVICE>_PORT=tcp://... in the env
        for container in spec["containers"] + spec.get("initContainers", []):
            context = container["securityContext"]
            assert context["readOnlyRootFilesystem"] is True
            assert context["allowPrivilegeEscalation"] is False
            assert context["capabilities"]["drop"] == ["ALL"]
            assert "/tmp" in {m["mountPath"] for m in container["volumeMounts"]}


# --- configuration the services read -----------------------------------------------------------------------


def _container_env(objs: list[dict], component: str) -> dict[str, str]:
    """What the container's process sees: the ConfigMap (envFrom), then literal env entries on top."""
    container = pod(objs, component)["containers"][0]
    env = {}
    for source in container.get("envFrom", []):
        env.update(one(objs, "ConfigMap", source["configMapRef"]["name"])["data"])
    env.update({e["name"]: e["value"] for e in container.get("env", []) if "value" in e})
    return env


@pytest.mark.parametrize("name", ["default", "cpu", "existing-claim", "tetris", "tp8"])
def test_services_accept_the_rendered_configuration(name: str, monkeypatch) -> None:
    """Each container's args and env, parsed by the real CLI, give a valid engine and distributed config."""
    objs = render(name)
    chart_values = yaml.safe_load((CHART / "values.yaml").read_text())
    values = renderer.merge(chart_values["scheduler"], COMBINATIONS[name].get("scheduler", {}))
    for component in ("verifier", "drafter", "scheduler"):
        for key in [k for k in os.environ if k.startswith("MINEDRAFT_")]:
            monkeypatch.delenv(key)
        for key, value in _container_env(objs, component).items():
            monkeypatch.setenv(key, value)
        args = build_parser().parse_args(pod(objs, component)["containers"][0]["args"])
        config = parsed_engine_config(args)
        assert config.tensor_parallel_size == COMBINATIONS[name].get("verifier", {}).get(
            "tensorParallelSize", 4 if name != "cpu" else 1
        )
        assert config.speculative_config is not None
        if component != "scheduler":
            dist = dist_config(args)
            expected = "127.0.0.1" if component == "verifier" else "minedraft-verifier.default.svc"
            assert (dist.master_addr, dist.master_port) == (expected, 29500)
            assert settings(args, WorkerSettings).step_drain_timeout == values["drainTimeoutSeconds"]
        else:
            _check_scheduler_settings(settings(args, SchedulerSettings), values)
    if name == "existing-claim":
        assert config.model == "/models/llama-3-8b"
        assert config.speculative_config.model == "/models/llama-3-draft"
    if name == "tetris":
        assert (config.speculative_config.tetris, config.speculative_config.tetris_capacity) == (True, 48)


def _check_scheduler_settings(settings: SchedulerSettings, values: dict[str, Any]) -> None:
    """The scheduler runs the chart's scheduler.* values."""
    expected = {"http_port": values["httpPort"], "max_prompt_bytes": values["maxPromptBytes"],
                "max_waiting_requests": values["maxWaitingRequests"], "metrics_port": values["metricsPort"],
                "request_drain_timeout": values["drainTimeoutSeconds"],
                "served_model_name": values.get("servedModelName") or None,
                "per_request_spec_decode_metrics": values.get("perRequestSpecDecodeMetrics") or None}  # fmt: skip
    assert {k: getattr(settings, k) for k in expected} == expected


def test_workers_are_reachable_while_loading() -> None:
    objs = render("default")
    data = configmap(objs)
    for component in ("verifier", "drafter"):
        service = one(objs, "Service", f"-{component}")
        # Headless and publishing not-ready pods: the drafter must rendezvous with a verifier that is
        # not ready yet (it becomes ready only after the drafter joined).
        assert service["spec"]["clusterIP"] == "None" and service["spec"]["publishNotReadyAddresses"] is True
        host = f"{service['metadata']['name']}.default.svc"
        assert data[f"MINEDRAFT_{component.upper()}"] == f"{host}:{service['spec']['ports'][0]['port']}"
    verifier = one(objs, "Service", "-verifier")
    assert {p["name"]: p["port"] for p in verifier["spec"]["ports"]} == {"grpc": 50061, "dist": 29500}
    assert data["MINEDRAFT_DIST_ADDR"] == "minedraft-verifier.default.svc"


def test_autoregressive_deploys_no_drafter() -> None:
    objs = render("extras-autoregressive")
    assert not find(objs, "Deployment", "-drafter") and not find(objs, "Service", "-drafter")
    assert not find(objs, "PodDisruptionBudget", "-drafter")
    assert engine_config(objs)["speculative_config"] is None
    verifier_policy = one(objs, "NetworkPolicy", "-verifier")
    assert len(verifier_policy["spec"]["ingress"]) == 1  # the scheduler only


# --- models and the HF token -------------------------------------------------------------------------------


def _mounts(spec: dict) -> dict[str, dict]:
    return {m["name"]: m for m in spec["containers"][0]["volumeMounts"]}


def test_existing_claim_is_mounted_and_pointed_at() -> None:
    objs = render("existing-claim")
    engine = engine_config(objs)
    assert engine["model"] == "/models/llama-3-8b"
    assert engine["speculative_config"]["model"] == "/models/llama-3-draft"
    assert not find(objs, "PersistentVolumeClaim")
    for component in ("verifier", "drafter", "scheduler"):
        spec = pod(objs, component)
        volume = next(v for v in spec["volumes"] if v["name"] == "models")
        assert volume["persistentVolumeClaim"]["claimName"] == "llm-models"
        assert _mounts(spec)["models"]["mountPath"] == "/models"
        assert _mounts(spec)["models"]["readOnly"] is True  # nothing downloads into it
        assert "initContainers" not in spec


def test_created_claim_with_download() -> None:
    objs = render("created-claim-download")
    claim = one(objs, "PersistentVolumeClaim")
    assert claim["metadata"]["annotations"]["helm.sh/resource-policy"] == "keep"
    assert claim["spec"]["resources"]["requests"]["storage"] == "500Gi"
    assert claim["spec"]["storageClassName"] == "fast"
    inits = {
        c: [i["name"] for i in pod(objs, c).get("initContainers", [])] for c in ("verifier", "drafter", "scheduler")
    }
    assert inits == {
        "verifier": ["download-target"],
        "drafter": ["download-draft", "download-target-config"],
        "scheduler": ["download-tokenizer"],
    }
    verifier_init = pod(objs, "verifier")["initContainers"][0]
    assert verifier_init["command"][-4:] == ["org/target", "/models/llama-3-8b", "v1", ""]
    # The scheduler fetches the tokenizer into its own emptyDir: no Multi-Attach of the claim on its node.
    scheduler_volume = next(v for v in pod(objs, "scheduler")["volumes"] if v["name"] == "models")
    assert "emptyDir" in scheduler_volume
    assert pod(objs, "scheduler")["initContainers"][0]["command"][-1] == "*.json"


def test_lora_flags_and_adapters_from_a_claim() -> None:
    """The LoRA values become the engine's flags, with each adapter's folders under the adapter volume, which
    the workers mount read-only (the scheduler reads no adapter)."""
    objs = render("lora-claim")
    engine = engine_config(objs)
    assert (engine["enable_lora"], engine["max_loras"], engine["max_cpu_loras"], engine["max_lora_rank"]) == (
        True, 2, None, 16)  # fmt: skip
    assert engine["lora_modules"] == [
        {"name": "sql", "path": "/adapters/sql", "draft_path": "/adapters/sql-draft"},
        {"name": "chat", "path": "/adapters/chat", "draft_path": None},
    ]
    assert EngineConfig.model_validate(engine).lora_modules[0].draft_path == "/adapters/sql-draft"
    for component in ("verifier", "drafter"):
        spec = pod(objs, component)
        volume = next(v for v in spec["volumes"] if v["name"] == "adapters")
        assert volume["persistentVolumeClaim"] == {"claimName": "adapters", "readOnly": True}
        assert _mounts(spec)["adapters"] == {"name": "adapters", "mountPath": "/adapters", "readOnly": True}
        assert "initContainers" not in spec
    assert "adapters" not in _mounts(pod(objs, "scheduler"))


def test_lora_adapters_downloaded_by_init_containers() -> None:
    """The verifier fetches the target's adapter, the drafter the draft's, each into its own emptyDir."""
    objs = render("lora-download")
    expected = {"verifier": ("download-adapter-0", "org/sql", "/adapters/sql"),
                "drafter": ("download-draft-adapter-0", "org/sql-draft", "/adapters/sql-draft")}  # fmt: skip
    for component, (name, repo, folder) in expected.items():
        spec = pod(objs, component)
        (init,) = spec["initContainers"]
        assert init["name"] == name and init["command"][-4:] == [repo, folder, "v2", ""]
        assert {"name": "adapters", "mountPath": "/adapters"} in init["volumeMounts"]
        assert next(v for v in spec["volumes"] if v["name"] == "adapters")["emptyDir"] == {"sizeLimit": "10Gi"}
        assert _mounts(spec)["adapters"]["readOnly"] is False


def test_lora_adapters_in_engine_group_pods() -> None:
    """engineGroups > 1: one pod per group, both workers mounting the adapters, both adapters fetched."""
    values = gpu_ok(renderer.merge(COMBINATIONS["lora-download"], {"engineGroups": 2}))
    spec = pod([m.obj for m in renderer.render(values)], "group")
    assert [i["name"] for i in spec["initContainers"]] == ["download-adapter-0", "download-draft-adapter-0"]
    mounts = {c["name"]: _mounts({"containers": [c]}) for c in spec["containers"]}
    assert ["adapters" in mounts[c] for c in ("verifier", "drafter", "scheduler")] == [True, True, False]


@pytest.mark.parametrize("name", ["created-claim-download", "empty-dir-download"])
def test_hf_token_only_as_secret_ref_in_download_containers(name: str) -> None:
    objs = render(name)
    secret = COMBINATIONS[name]["hfToken"]
    for component in ("verifier", "drafter", "scheduler"):
        spec = pod(objs, component)
        for container in spec["initContainers"]:
            token = next(e for e in container["env"] if e["name"] == "HF_TOKEN")
            assert token == {
                "name": "HF_TOKEN",
                "valueFrom": {"secretKeyRef": {"name": secret["existingSecret"], "key": secret.get("key", "HF_TOKEN")}},
            }
        # The serving containers load local files only and never get the token.
        assert "HF_TOKEN" not in {e["name"] for e in spec["containers"][0].get("env", [])}
    for obj in find(objs, "ConfigMap"):
        assert not any("TOKEN" in key or "hf_" in value for key, value in obj["data"].items())
    literal_env = [
        e for d in find(objs, "Deployment")
        for c in d["spec"]["template"]["spec"]["containers"] + d["spec"]["template"]["spec"].get("initContainers", [])
        for e in c.get("env", []) if "value" in e
    ]  # fmt: skip
    assert not [e for e in literal_env if any(word in e["name"] for word in ("TOKEN", "SECRET", "PASSWORD"))]


# --- NetworkPolicy, PDB, ServiceMonitor ----------------------------------------------------------------------


def _selects(peer: dict, component: str) -> bool:
    return peer.get("podSelector", {}).get("matchLabels", {}).get("app.kubernetes.io/component") == component


def test_network_policies() -> None:
    objs = render("extras")
    scheduler = one(objs, "NetworkPolicy", "-scheduler")["spec"]["ingress"]
    assert scheduler[0]["ports"] == [{"port": 50051, "protocol": "TCP"}, {"port": 8000, "protocol": "TCP"}]
    assert scheduler[0]["from"] == COMBINATIONS["extras"]["networkPolicy"]["clientFrom"]
    assert scheduler[1] == {"ports": [{"port": 7450, "protocol": "TCP"}]}  # metrics: from anywhere by default
    for component, peer, port in (("verifier", "drafter", 50061), ("drafter", "verifier", 50062)):
        control, distributed = one(objs, "NetworkPolicy", f"-{component}")["spec"]["ingress"]
        assert [_selects(p, "scheduler") for p in control["from"]] == [True]
        assert control["ports"] == [{"port": port, "protocol": "TCP"}]
        # NCCL/gloo pick ephemeral ports: the peer worker gets every port, nobody else any.
        assert [_selects(p, peer) for p in distributed["from"]] == [True] and "ports" not in distributed


def test_pod_disruption_budgets_and_service_monitor() -> None:
    objs = render("extras")
    budgets = [b for b in find(objs, "PodDisruptionBudget") if not b["metadata"]["name"].endswith("-gateway")]
    assert sorted(b["metadata"]["name"] for b in budgets) == [
        "minedraft-drafter", "minedraft-scheduler", "minedraft-verifier",
    ]  # fmt: skip
    for budget in budgets:
        assert budget["spec"]["maxUnavailable"] == 0
        assert budget["spec"]["unhealthyPodEvictionPolicy"] == "AlwaysAllow"  # never blocks a drain when broken
    monitor = one(objs, "ServiceMonitor")
    assert monitor["metadata"]["labels"]["release"] == "prometheus"
    assert not find(render("default"), "ServiceMonitor")


@pytest.mark.parametrize("name", ["default", "cpu"])
def test_network_policies_are_on_by_default(name: str) -> None:
    """The workers' control ports and the rendezvous port are reachable from their engine group only."""
    objs = render(name)
    assert sorted(p["metadata"]["name"] for p in find(objs, "NetworkPolicy")) == [
        "minedraft-drafter", "minedraft-scheduler", "minedraft-verifier",
    ]  # fmt: skip
    verifier_ingress = one(objs, "NetworkPolicy", "-verifier")["spec"]["ingress"]
    rendezvous = int(configmap(objs)["MINEDRAFT_DIST_PORT"])
    assert all("from" in rule for rule in verifier_ingress)  # nobody outside the group, on any port
    assert not any(rendezvous == p["port"] for rule in verifier_ingress for p in rule.get("ports", []))
    assert not find(render("no-http-no-policy"), "NetworkPolicy")


# --- the OpenAI HTTP API, API keys and TLS ------------------------------------------------------------------


def _ports(objs: list[dict]) -> dict[str, dict]:
    return {p["name"]: p for p in one(objs, "Service", "-scheduler")["spec"]["ports"]}


def test_http_port_is_served_and_exposed() -> None:
    objs = render("default")
    container = pod(objs, "scheduler")["containers"][0]
    assert {"name": "http", "containerPort": 8000, "protocol": "TCP"} in container["ports"]
    assert _ports(objs)["http"] == {"name": "http", "port": 8000, "targetPort": "http", "protocol": "TCP",
                                    "appProtocol": "http"}  # fmt: skip
    assert configmap(objs)["MINEDRAFT_HTTP_PORT"] == "8000"
    assert "http" not in _ports(render("no-http-no-policy"))
    assert configmap(render("no-http-no-policy"))["MINEDRAFT_HTTP_PORT"] == "0"


def test_api_keys_and_tls_come_from_existing_secrets() -> None:
    objs = render("tls-keys")
    spec = pod(objs, "scheduler")
    env = {e["name"]: e for e in spec["containers"][0]["env"]}
    assert env["MINEDRAFT_API_KEYS"]["valueFrom"]["secretKeyRef"] == {"name": "minedraft-api-keys", "key": "api-keys"}
    assert env["MINEDRAFT_TLS_CERT"]["value"] == "/etc/minedraft/tls/tls.crt"
    assert env["MINEDRAFT_TLS_KEY"]["value"] == "/etc/minedraft/tls/tls.key"
    mounts = {m["name"]: m for m in spec["containers"][0]["volumeMounts"]}
    assert mounts["tls"] == {"name": "tls", "mountPath": "/etc/minedraft/tls", "readOnly": True}
    assert {v["name"]: v for v in spec["volumes"]}["tls"]["secret"]["secretName"] == "minedraft-tls"
    assert configmap(objs)["MINEDRAFT_SERVED_MODEL_NAME"] == "llama-3-8b"
    assert _ports(objs)["http"]["appProtocol"] == "https"
    for component in ("verifier", "drafter"):  # the workers get neither
        assert "tls" not in json.dumps(pod(objs, component)["volumes"])
        assert "MINEDRAFT_API_KEYS" not in json.dumps(pod(objs, component))
    assert "MINEDRAFT_API_KEYS" not in json.dumps(render("default"))


@pytest.mark.parametrize("name", ["tls-keys", "cert-manager"])
def test_with_tls_the_scheduler_probes_health_over_https(name: str) -> None:
    container = pod(render(name), "scheduler")["containers"][0]
    for kind in ("startupProbe", "readinessProbe", "livenessProbe"):
        assert container[kind]["httpGet"] == {"path": "/health", "port": "http", "scheme": "HTTPS"}
        assert "grpc" not in container[kind]


def test_cert_manager_certificate_names_the_services() -> None:
    """The scheduler's and the gateway's: both serve this certificate."""
    certificate = one(render("cert-manager"), "Certificate")
    assert certificate["spec"]["secretName"] == "minedraft-scheduler-tls"
    assert certificate["spec"]["issuerRef"] == {"name": "ca", "kind": "ClusterIssuer", "group": "cert-manager.io"}
    assert certificate["spec"]["dnsNames"] == [
        "minedraft-scheduler", "minedraft-scheduler.default", "minedraft-scheduler.default.svc",
        "minedraft-scheduler.default.svc.cluster.local", "minedraft-gateway", "minedraft-gateway.default",
        "minedraft-gateway.default.svc", "minedraft-gateway.default.svc.cluster.local", "llm.example.com",
    ]  # fmt: skip
    assert not find(render("default"), "Certificate")


def test_notes_print_the_port_forward_and_bench_commands() -> None:
    with helm.Chart.load(renderer.CHART_DIR) as chart:
        notes = chart.render(values=gpu_ok({}), name="minedraft", namespace="default")["minedraft/templates/NOTES.txt"]
    assert "kubectl --namespace default port-forward svc/minedraft-gateway 50051:50051" in notes
    assert "minedraft bench --target 127.0.0.1:50051" in notes
    assert "curl http://127.0.0.1:8000/v1/models" in notes
    assert "minedraft bench --k8s --namespace default --service minedraft-gateway" in notes


# --- bad values fail the install with a message --------------------------------------------------------------


@pytest.mark.parametrize(
    ("values", "message"),
    [
        ({"verifier": {"tensorParallelSize": 0}}, "at '/verifier/tensorParallelSize': minimum: got 0, want 1"),
        ({"verifier": {"tensorParallelSize": "4"}}, "at '/verifier/tensorParallelSize': got string, want integer"),
        ({"speculativeConfig": {"num_speculative_token": 4}}, "'num_speculative_token' not allowed"),
        ({"speculativeConfig": {"num_speculative_tokens": "four"}}, "got string, want integer"),
        ({"speculativeConfig": {"draft_tensor_parallel_size": 2}}, "/speculativeConfig/draft_tensor_parallel_size"),
        ({"scheduler": {"replicas": 2}}, "at '/scheduler/replicas': maximum: got 2, want 1"),
        ({"engine": {"device": "tpu"}}, "/engine/device"),
        ({"models": {"volume": {"type": "nfs"}}}, "/models/volume/type"),
        ({"hfToken": {"token": TOKEN}}, "'token' not allowed"),
        ({"verifierr": {}}, "'verifierr' not allowed"),
        ({"apiKeys": {"keys": ["k"]}}, "'keys' not allowed"),
        ({"tls": {"cert": "PEM"}}, "'cert' not allowed"),
        ({"tls": {"certManager": {"issuerRef": {"kind": "Vault"}}}}, "/tls/certManager/issuerRef/kind"),
        ({"scheduler": {"httpPort": 70000}}, "/scheduler/httpPort"),
    ],
)
def test_schema_rejects_bad_values(values: dict, message: str) -> None:
    with pytest.raises(helm.HelmValuesError, match="values don't meet the specifications") as error:
        renderer.render(gpu_ok(values))
    assert message in str(error.value)


@pytest.mark.parametrize(
    ("values", "message"),
    [
        ({"models": {"target": "llama"}}, "set models.volume.type to existingClaim, createClaim or emptyDir"),
        ({"models": {"target": "x", "volume": {"type": "existingClaim"}}}, "needs models.volume.existingClaim"),
        ({"models": {"target": "x", "volume": {"type": "emptyDir"}}}, "emptyDir starts empty"),
        ({"speculativeConfig": {"force_pearl": True, "is_parallel": False}}, "force_pearl requires"),
        ({"models": {"draft": "d", "volume": {"type": "existingClaim", "existingClaim": "c"}},
          "speculativeConfig": {"model": "/elsewhere"}}, "not both"),
        ({"models": {"draft": "d", "volume": {"type": "existingClaim", "existingClaim": "c"}},
          "speculativeConfig": None}, "without speculation there is no drafter"),
        ({"tls": {"existingSecret": "t"}, "scheduler": {"httpPort": 0}}, "TLS needs scheduler.httpPort"),
        ({"tls": {"existingSecret": "t", "certManager": {"enabled": True, "issuerRef": {"name": "ca"}}}},
         "not both"),
        ({"tls": {"certManager": {"enabled": True}}}, "needs tls.certManager.issuerRef.name"),
        ({"scheduler": {"terminationGracePeriodSeconds": 30}}, "killed while it drains"),
        ({"engine": {"loraModules": [{"name": "a", "path": "a"}]}}, "engine.loraModules needs engine.enableLora"),
        ({"engine": {"enableLora": True, "loraModules": [{"name": "a", "path": "a"}]}},
         "set loraAdapters.volume.type to existingClaim or emptyDir"),
        ({"engine": {"enableLora": True, "loraModules": [{"name": "a", "path": "a"}]},
          "loraAdapters": {"volume": {"type": "emptyDir"}, "download": {"enabled": True}}}, 'adapter "a" a repo'),
        ({"scheduler": {"drainTimeoutSeconds": 120, "terminationGracePeriodSeconds": 130}},
         r"verifier.terminationGracePeriodSeconds \(60\) must be"),
    ],
)  # fmt: skip
def test_inconsistent_values_fail_with_what_to_change(values: dict, message: str) -> None:
    with pytest.raises(helm.HelmRenderError, match=message):
        renderer.render(gpu_ok(values))


# --- one source of truth: the chart's values and the engine's pydantic models agree ----------------------

# Where each EngineConfig field comes from in the values (the rest of the rendered config is derived).
ENGINE_VALUES = {
    "tensor_parallel_size": ("verifier", "tensorParallelSize"),
    "max_num_seqs": ("engine", "maxNumSeqs"),
    "max_model_len": ("engine", "maxModelLen"),
    "dtype": ("engine", "dtype"),
    "device": ("engine", "device"),
    "seed": ("engine", "seed"),
    "batch_invariant": ("engine", "batchInvariant"),
    "draft_support_size": ("engine", "draftSupportSize"),
    "kv_cache_memory_bytes": ("engine", "kvCacheMemoryBytes"),
    "gpu_memory_utilization": ("engine", "gpuMemoryUtilization"),
    "block_size": ("engine", "blockSize"),
    "max_num_batched_tokens": ("engine", "maxNumBatchedTokens"),
    "max_prediction_tokens": ("engine", "maxPredictionTokens"),
    "prediction_draft_tokens": ("engine", "predictionDraftTokens"),
    "enable_prefix_caching": ("engine", "enablePrefixCaching"),
    "enforce_eager": ("engine", "enforceEager"),
    "enable_lora": ("engine", "enableLora"),
    "max_loras": ("engine", "maxLoras"),
    "max_cpu_loras": ("engine", "maxCpuLoras"),
    "max_lora_rank": ("engine", "maxLoraRank"),
    "allow_runtime_lora_updating": ("engine", "allowRuntimeLoraUpdating"),
}
DERIVED = {"model": "models.target", "tokenizer": "models.tokenizer", "speculative_config": "speculativeConfig",
           "lora_modules": "engine.loraModules",
           "lora_root": "loraAdapters.mountPath"}


def _schema(*path: str) -> dict[str, Any]:
    node = json.loads((CHART / "values.schema.json").read_text())
    for key in path:
        node = node["properties"][key]
    return node


def _schema_bounds(schema: dict[str, Any]) -> dict[str, Any]:
    words = ("minimum", "maximum", "enum")
    return {k: sorted(v, key=str) if k == "enum" else v for k, v in schema.items() if k in words}


def _bounds(field) -> dict[str, Any]:
    """The numeric bounds and choices of a pydantic field, in JSON-schema words."""
    out: dict[str, Any] = {}
    for rule in field.metadata:
        for attr, word in (("ge", "minimum"), ("le", "maximum")):
            if getattr(rule, attr, None) is not None:
                out[word] = getattr(rule, attr)
    choices = [a for a in typing.get_args(field.annotation) if typing.get_origin(a) is typing.Literal]
    if typing.get_origin(field.annotation) is typing.Literal:
        choices = [field.annotation]
    if choices:
        out["enum"] = sorted(typing.get_args(choices[0]), key=str)
    return out


def test_every_engine_field_has_one_place_in_the_values() -> None:
    assert set(ENGINE_VALUES) | set(DERIVED) == set(EngineConfig.model_fields)
    assert set(engine_config(render("default"))) == set(EngineConfig.model_fields)
    assert set(_schema("speculativeConfig")["properties"]) == set(SpeculativeConfig.model_fields)


@pytest.mark.parametrize("name", sorted(ENGINE_VALUES))
def test_chart_bounds_equal_the_engine_bounds(name: str) -> None:
    schema = _schema(*ENGINE_VALUES[name])
    expected = _bounds(EngineConfig.model_fields[name])
    if name == "device":  # the chart picks the resource kind: GPUs or none; cuda:N is for one host
        assert set(schema["enum"]) <= {"cpu", "cuda"}
        return
    assert _schema_bounds(schema) == expected


@pytest.mark.parametrize("name", sorted(SpeculativeConfig.model_fields))
def test_speculative_bounds_equal_the_engine_bounds(name: str) -> None:
    assert _schema_bounds(_schema("speculativeConfig", name)) == _bounds(SpeculativeConfig.model_fields[name])


def test_every_engine_value_reaches_the_rendered_config() -> None:
    """Non-default values in, the same values out, and the result is a valid EngineConfig."""
    values = {
        "engine": {"maxNumSeqs": 7, "maxModelLen": 1024, "dtype": "float16", "device": "cpu", "seed": 11,
                   "batchInvariant": True, "draftSupportSize": 8, "kvCacheMemoryBytes": 20 << 30,
                   "gpuMemoryUtilization": 0.8, "blockSize": 32, "maxNumBatchedTokens": 512,
                   "maxPredictionTokens": 100, "predictionDraftTokens": 5,
                   "enablePrefixCaching": False, "enforceEager": True, "enableLora": True, "maxLoras": 3,
                   "maxCpuLoras": 5, "maxLoraRank": 64, "allowRuntimeLoraUpdating": True},
        "verifier": {"tensorParallelSize": 2},
        "models": {"target": "t", "draft": "d", "volume": {"type": "existingClaim", "existingClaim": "m"}},
        "loraAdapters": {"volume": {"type": "existingClaim", "existingClaim": "a"}},
        "speculativeConfig": {"num_speculative_tokens": 3, "tetris": True},
    }  # fmt: skip
    config = json.loads(one([m.obj for m in renderer.render(values)], "ConfigMap")["data"]["MINEDRAFT_ENGINE_CONFIG"])
    parsed = EngineConfig.model_validate(config)
    for name, (section, key) in ENGINE_VALUES.items():
        assert getattr(parsed, name) == values[section][key], name
    assert parsed.model == "/models/t" and parsed.speculative_config.model == "/models/d"
    assert parsed.lora_root == "/adapters"  # loraAdapters.mountPath
    assert (parsed.speculative_config.num_speculative_tokens, parsed.speculative_config.tetris) == (3, True)


@pytest.mark.parametrize(
    ("values", "message"),
    [
        ({}, "no model named: models.target is empty, so the verifier would load the bundled development pair"),
        ({"models": {"target": "t", "volume": {"type": "existingClaim", "existingClaim": "m"}}}, "no draft named"),
    ],
)
def test_gpu_values_refuse_the_bundled_pair(values: dict, message: str) -> None:
    """The bundled pair is a development model: on GPUs the user names checkpoints (or says it is a test)."""
    with pytest.raises(helm.HelmRenderError, match=message):
        renderer.render(values)
    assert renderer.render(gpu_ok(values))  # the smoke-test switch
    autoregressive = {**values, "speculativeConfig": None}
    if values:  # a named target without speculation needs no draft
        assert renderer.render(autoregressive)
    configmap_data = configmap([m.obj for m in renderer.render(GPU_EXAMPLE)])  # the example names both
    config = json.loads(configmap_data["MINEDRAFT_ENGINE_CONFIG"])
    assert (config["model"], config["speculative_config"]["model"]) == ("/models/qwen3-8b", "/models/qwen3-0.6b")


LOOKUP = {"models": {"target": "t", "volume": {"type": "existingClaim", "existingClaim": "m"}},
          "speculativeConfig": {"method": "ngram", "prompt_lookup_max": 3}}  # fmt: skip


def _drafter_containers(objs: list[dict]) -> list[dict]:
    specs = [o["spec"]["template"]["spec"] for o in objs if o["kind"] in ("Deployment", "StatefulSet")]
    return [c for spec in specs for c in spec["containers"] if "drafter" in c["name"]]


@pytest.mark.parametrize("groups", [1, 2])
def test_a_drafter_without_a_model_takes_no_gpu_and_needs_no_draft(groups: int) -> None:
    """method ngram on GPUs: no models.draft asked for, the drafter container takes no GPU, the verifier its own."""
    objs = [m.obj for m in renderer.render({**LOOKUP, "engineGroups": groups})]
    drafters = _drafter_containers(objs)
    assert drafters and all(_gpus({"containers": [c]}) is None for c in drafters)
    spec = engine_config(objs)["speculative_config"]
    assert (spec["method"], spec["prompt_lookup_max"], spec.get("model")) == ("ngram", 3, None)
    assert EngineConfig.model_validate(engine_config(objs)).drafts_without_model
    with pytest.raises(helm.HelmRenderError, match="method ngram drafts without a model: leave models.draft empty"):
        renderer.render({**LOOKUP, "models": {**LOOKUP["models"], "draft": "d"}})
