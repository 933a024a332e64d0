"""The chart's drafter pool (drafterPool): drafters shared by the engine groups, in a Deployment of their own.

Rendered with the Helm library and strictly validated against the Kubernetes schemas, in both topologies
(engineGroups 1: scheduler and verifier Deployments; engineGroups > 1: one pod per group): where the members
run (a GPU each, none for a method that drafts without a model), how the schedulers find them (a headless
Service; no drafter of a group's own), the PDB, KEDA's ScaledObject on the pool's queue, the NetworkPolicy
rules (only the groups reach the pool; the members reach only the verifiers' gRPC port), and what the render
refuses. The capacity table of docs/kubernetes.md is checked against the script that prints it."""

from __future__ import annotations

import importlib.util
import json
import os
import re
import sys
from pathlib import Path
from typing import Any

import helm_python as helm
import kubernetes_validate
import pytest

from minedraft.cli import build_parser
from minedraft.cli import serve as serve_cli
from minedraft.cli.common import engine_config as parsed_engine_config
from minedraft.cli.flags import model_from_args
from minedraft.config import EngineConfig

ROOT = Path(__file__).resolve().parents[1]
KUBE_VERSION = "1.35.0"


def _load(name: str, path: Path):
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module  # dataclasses look their module up while the class is built
    spec.loader.exec_module(module)
    return module


renderer = _load("render_manifests", ROOT / "scripts" / "render_manifests.py")
CPU = renderer.profile_values("cpu")
POOL = {"drafterPool": {"replicas": 2}}
GROUPS = {"engineGroups": 3}
CLAIM = {"target": "qwen3-32b", "draft": "qwen3-0.6b", "volume": {"type": "existingClaim", "existingClaim": "models"}}
NGRAM = {"speculativeConfig": {"method": "ngram", "prompt_lookup_max": 3},
         "models": {"target": "qwen3-32b", "volume": {"type": "existingClaim", "existingClaim": "models"}}}  # fmt: skip
SCALED = {"drafterPool": {"replicas": 1, "autoscaling": {"enabled": True, "minReplicas": 2, "maxReplicas": 5,
                                                         "queuedStepsPerMember": 6}},
          "serviceMonitor": {"enabled": True}}  # fmt: skip
COMBINATIONS: dict[str, dict[str, Any]] = {
    "pool": POOL,
    "pool-groups": {**POOL, **GROUPS},
    "pool-cpu": renderer.merge(CPU, POOL),
    "pool-groups-cpu": renderer.merge(CPU, {**POOL, **GROUPS}),
    "pool-ngram": {**NGRAM, **POOL},
    "pool-groups-ngram": {**NGRAM, **POOL, **GROUPS},
    "pool-claim": {**POOL, "models": CLAIM},
    "pool-download": {**POOL, "models": {**CLAIM, "volume": {"type": "createClaim"},
                                         "download": {"enabled": True, "target": "Qwen/Qwen3-32B",
                                                      "draft": "Qwen/Qwen3-0.6B"}},
                      "hfToken": {"existingSecret": "hf-token"}},
    "pool-scaled": SCALED,
    "pool-groups-scaled": {**SCALED, "engineGroups": 4,
                           "autoscaling": {"enabled": True, "maxGroups": 8}},
    "pool-placement": {"drafterPool": {
        "replicas": 1, "gpuResourceName": "nvidia.com/mig-3g.40gb", "runtimeClassName": "nvidia",
        "nodeSelector": {"gpu": "l4"},
        "tolerations": [{"key": "small-gpu", "operator": "Exists", "effect": "NoSchedule"}],
        "affinity": {"nodeAffinity": {"requiredDuringSchedulingIgnoredDuringExecution": {"nodeSelectorTerms": [
            {"matchExpressions": [{"key": "zone", "operator": "In", "values": ["a"]}]}]}}},
        "podAnnotations": {"team": "drafts"}, "extraEnv": [{"name": "EXTRA", "value": "1"}]}},
    "pool-no-pdb-policy": {"drafterPool": {"replicas": 1, "podDisruptionBudget": {"enabled": False}},
                           "networkPolicy": {"enabled": False}},
}  # fmt: skip
CRDS = ("ServiceMonitor", "ScaledObject")


def gpu_ok(values: dict[str, Any]) -> dict[str, Any]:
    """`values` with the bundled pair allowed on GPUs (the chart's structure is what is tested here)."""
    return renderer.merge({"models": {"allowBundledOnGpus": True}}, values)


def render(values: dict[str, Any] | str) -> list[dict[str, Any]]:
    values = COMBINATIONS[values] if isinstance(values, str) else values
    return [m.obj for m in renderer.render(gpu_ok(values))]


def find(objs: list[dict], kind: str, name: str | None = None) -> list[dict]:
    return [o for o in objs if o["kind"] == kind and (name is None or o["metadata"]["name"] == name)]


def one(objs: list[dict], kind: str, name: str) -> dict:
    found = find(objs, kind, name)
    assert len(found) == 1, f"expected one {kind} {name}, got {len(found)}"
    return found[0]


def pod_spec(objs: list[dict], name: str) -> dict:
    return one(objs, "Deployment", name)["spec"]["template"]["spec"]


def container(objs: list[dict], name: str, container_name: str) -> dict:
    return next(c for c in pod_spec(objs, name)["containers"] if c["name"] == container_name)


def member(objs: list[dict]) -> dict:
    (drafter,) = pod_spec(objs, "minedraft-drafter-pool")["containers"]
    return drafter


def process_env(objs: list[dict], name: str, container_name: str, pod_ip: str = "10.1.2.3") -> dict[str, str]:
    """What the container's process sees: the ConfigMap (envFrom), then its env entries, with the pod's IP for
    status.podIP and $(VAR) expanded as the kubelet does."""
    spec = container(objs, name, container_name)
    env: dict[str, str] = {}
    for source in spec.get("envFrom", []):
        env.update(one(objs, "ConfigMap", source["configMapRef"]["name"])["data"])
    for entry in spec.get("env", []):
        if entry.get("valueFrom", {}).get("fieldRef", {}).get("fieldPath") == "status.podIP":
            env[entry["name"]] = pod_ip
        elif "value" in entry:
            env[entry["name"]] = re.sub(r"\$\((\w+)\)", lambda m: env.get(m.group(1), m.group(0)), entry["value"])
    return env


def _selects(peer: dict, component: str) -> bool:
    return peer.get("podSelector", {}).get("matchLabels", {}).get("app.kubernetes.io/component") == component


def _gpus(spec: dict, resource: str = "nvidia.com/gpu") -> Any:
    return spec["resources"].get("limits", {}).get(resource)


# --- rendering, lint, Kubernetes schemas -----------------------------------------------------------------


@pytest.mark.parametrize("name", sorted(COMBINATIONS))
def test_every_object_validates(name: str) -> None:
    for obj in render(name):
        if obj["kind"] in CRDS:  # no schema in kubernetes-validate; the ScaledObject is checked below
            continue
        try:
            kubernetes_validate.validate(obj, KUBE_VERSION, strict=True)
        except kubernetes_validate.ValidationError as exc:
            pytest.fail(f"{obj['kind']} {obj['metadata']['name']}: {exc.message}")


@pytest.mark.parametrize("name", ["pool", "pool-groups", "pool-scaled", "pool-ngram"])
def test_lint_is_clean(name: str) -> None:
    report = helm.lint(renderer.CHART_DIR, values=gpu_ok(COMBINATIONS[name]), strict=True,
                       kube_version=f"v{KUBE_VERSION}")  # fmt: skip
    assert not [m for m in report["messages"] if m["severity"] >= 2] + report["errors"]


@pytest.mark.parametrize("groups", [1, 3])
def test_replicas_zero_keeps_one_drafter_per_group(groups: int) -> None:
    """drafterPool.replicas 0 (the default) renders exactly today's topology, whatever the pool's other keys say."""
    base = {"engineGroups": groups}
    off = {**base, "drafterPool": {"replicas": 0, "poolGroups": 9, "port": 50099, "autoscaling": {"enabled": True}}}
    assert render(off) == render(base)
    assert not [o for o in render(base) if "drafter-pool" in o["metadata"]["name"]]


# --- placement -----------------------------------------------------------------------------------------------


@pytest.mark.parametrize("name", ["pool", "pool-groups"])
def test_members_take_one_gpu_each_on_gpu_nodes_spread_over_nodes(name: str) -> None:
    objs = render(name)
    deployment = one(objs, "Deployment", "minedraft-drafter-pool")
    assert deployment["spec"]["replicas"] == 2
    # one member at a time, no surge (a surge member would need a GPU more)
    assert deployment["spec"]["strategy"] == {"type": "RollingUpdate",
                                              "rollingUpdate": {"maxSurge": 0, "maxUnavailable": 1}}  # fmt: skip
    spec = deployment["spec"]["template"]["spec"]
    assert spec["nodeSelector"] == {"nvidia.com/gpu.present": "true"}
    assert spec["tolerations"] == [{"key": "nvidia.com/gpu", "operator": "Exists", "effect": "NoSchedule"}]
    drafter = member(objs)
    assert _gpus(drafter) == 1
    assert drafter["resources"]["requests"] == {"cpu": "4", "memory": "16Gi"}
    assert drafter["args"] == ["drafter", "--port", "50062"]
    # no pod affinity to a verifier: a member drafts for groups on any node
    assert "podAffinity" not in spec["affinity"]
    spread = spec["affinity"]["podAntiAffinity"]["preferredDuringSchedulingIgnoredDuringExecution"][0]
    assert spread["podAffinityTerm"]["topologyKey"] == "kubernetes.io/hostname"
    assert spread["podAffinityTerm"]["labelSelector"]["matchLabels"]["app.kubernetes.io/component"] == "drafter-pool"
    # no torch.distributed world: no rendezvous, no /dev/shm, no hostIPC
    assert "/dev/shm" not in {m["mountPath"] for m in drafter["volumeMounts"]} and not spec.get("hostIPC")
    assert spec["automountServiceAccountToken"] is False and spec["enableServiceLinks"] is False
    context = drafter["securityContext"]
    assert context["readOnlyRootFilesystem"] is True and context["capabilities"]["drop"] == ["ALL"]
    for probe in ("startupProbe", "readinessProbe", "livenessProbe"):
        assert drafter[probe]["grpc"] == {"port": 50062, "service": ""}


def test_placement_values_land_on_the_members() -> None:
    objs = render("pool-placement")
    values = COMBINATIONS["pool-placement"]["drafterPool"]
    spec = pod_spec(objs, "minedraft-drafter-pool")
    # a user's nodeSelector is merged with the default GPU label, as the other workers' are
    assert spec["nodeSelector"] == {"nvidia.com/gpu.present": "true", "gpu": "l4"}
    assert spec["tolerations"] == values["tolerations"]
    assert spec["runtimeClassName"] == "nvidia"
    assert spec["affinity"]["nodeAffinity"] == values["affinity"]["nodeAffinity"]
    assert "podAntiAffinity" in spec["affinity"]  # the spread is kept beside a user's node affinity
    assert _gpus(member(objs), "nvidia.com/mig-3g.40gb") == 1 and _gpus(member(objs)) is None
    annotations = one(objs, "Deployment", "minedraft-drafter-pool")["spec"]["template"]["metadata"]["annotations"]
    assert annotations["team"] == "drafts"
    assert {"name": "EXTRA", "value": "1"} in member(objs)["env"]


@pytest.mark.parametrize("name", ["pool-ngram", "pool-groups-ngram"])
def test_a_pool_without_a_model_takes_no_gpu_and_no_gpu_node(name: str) -> None:
    """ngram drafts on the CPU: no GPU, no GPU node (drafterPool.withoutModel), no models.draft asked for."""
    objs = render(name)
    spec = pod_spec(objs, "minedraft-drafter-pool")
    assert "nodeSelector" not in spec and "tolerations" not in spec
    assert "nvidia.com/gpu" not in member(objs)["resources"].get("limits", {})
    assert member(objs)["resources"]["requests"] == {"cpu": "2", "memory": "4Gi"}
    config = json.loads(one(objs, "ConfigMap", "minedraft-engine")["data"]["MINEDRAFT_ENGINE_CONFIG"])
    assert EngineConfig.model_validate(config).drafts_without_model
    assert "model" not in config["speculative_config"]
    # the groups' verifiers keep their GPUs
    verifier = container(objs, "minedraft-verifier" if name == "pool-ngram" else "minedraft-group", "verifier")
    assert _gpus(verifier) == 4


@pytest.mark.parametrize("name", ["pool-cpu", "pool-groups-cpu"])
def test_the_cpu_profile_pool_asks_for_no_gpu(name: str) -> None:
    objs = render(name)
    assert "nvidia" not in json.dumps([o for o in objs if "drafter-pool" in o["metadata"]["name"]])
    assert pod_spec(objs, "minedraft-drafter-pool")["nodeSelector"] == {"minedraft/pool": "cpu"}
    assert member(objs)["resources"]["requests"] == {"cpu": "250m", "memory": "256Mi"}


def test_models_from_a_claim_are_mounted_read_only() -> None:
    objs = render("pool-claim")
    spec = pod_spec(objs, "minedraft-drafter-pool")
    assert next(v for v in spec["volumes"] if v["name"] == "models")["persistentVolumeClaim"] == {
        "claimName": "models", "readOnly": True}  # fmt: skip
    assert {"name": "models", "mountPath": "/models", "readOnly": True} in member(objs)["volumeMounts"]
    assert "initContainers" not in spec


def test_with_download_each_member_fetches_its_draft_into_its_own_volume() -> None:
    """Members run on any node, where the release's ReadWriteOnce claim cannot follow them."""
    objs = render("pool-download")
    spec = pod_spec(objs, "minedraft-drafter-pool")
    assert next(v for v in spec["volumes"] if v["name"] == "models") == {
        "name": "models",
        "emptyDir": {"sizeLimit": "40Gi"},
    }
    inits = {c["name"]: c for c in spec["initContainers"]}
    assert list(inits) == ["download-draft", "download-target-config"]
    assert inits["download-draft"]["command"][-4:] == ["Qwen/Qwen3-0.6B", "/models/qwen3-0.6b", "", ""]
    assert inits["download-target-config"]["command"][-4:] == ["Qwen/Qwen3-32B", "/models/qwen3-32b", "", "*.json"]
    token = next(e for e in inits["download-draft"]["env"] if e["name"] == "HF_TOKEN")
    assert token["valueFrom"]["secretKeyRef"]["name"] == "hf-token"
    assert "HF_TOKEN" not in {e["name"] for e in member(objs)["env"]}
    # the verifier no longer fetches a draft of its own
    assert [c["name"] for c in pod_spec(objs, "minedraft-verifier").get("initContainers", [])] == ["download-target"]


# --- discovery -----------------------------------------------------------------------------------------------


@pytest.mark.parametrize(("name", "scheduler"), [("pool", "minedraft-scheduler"), ("pool-groups", "minedraft-group")])
def test_every_scheduler_finds_the_pool_through_its_headless_service(name: str, scheduler: str) -> None:
    objs = render(name)
    service = one(objs, "Service", "minedraft-drafter-pool")
    assert service["spec"]["clusterIP"] == "None"  # one DNS address per member
    assert service["spec"]["publishNotReadyAddresses"] is False  # a loading or draining member is not offered
    template = one(objs, "Deployment", "minedraft-drafter-pool")["spec"]["template"]
    assert service["spec"]["selector"].items() <= template["metadata"]["labels"].items()
    assert service["spec"]["ports"] == [{"name": "grpc", "port": 50062, "targetPort": "grpc", "protocol": "TCP",
                                         "appProtocol": "grpc"}]  # fmt: skip
    env = process_env(objs, scheduler, "scheduler")
    assert env["MINEDRAFT_DRAFTER_POOL"] == "minedraft-drafter-pool.default.svc:50062"
    assert "MINEDRAFT_DRAFTER" not in env  # ignored with a pool, and not rendered
    assert process_env(objs, "minedraft-drafter-pool", "drafter")["MINEDRAFT_POOL_GROUPS"] == "4"


@pytest.mark.parametrize("name", ["pool", "pool-groups", "pool-ngram", "pool-groups-ngram"])
def test_no_group_has_a_drafter_of_its_own(name: str) -> None:
    objs = render({**COMBINATIONS[name], "podDisruptionBudget": {"enabled": True}})
    names = {o["metadata"]["name"] for o in objs}
    assert not names & {"minedraft-drafter"}  # no Deployment, Service, PDB or NetworkPolicy of that name
    containers = [c["name"] for d in find(objs, "Deployment") for c in d["spec"]["template"]["spec"]["containers"]]
    assert containers.count("drafter") == 1  # the pool member's, nothing else
    assert "MINEDRAFT_DRAFTER" not in one(objs, "ConfigMap", "minedraft-engine")["data"]
    if "groups" in name:
        assert [c["name"] for c in pod_spec(objs, "minedraft-group")["containers"]] == ["scheduler", "verifier"]


def test_a_group_pod_gives_the_pool_its_own_address_for_the_verifier() -> None:
    """engineGroups > 1: the scheduler's verifier is in its pod, but the members push drafts to the address the
    scheduler names, so it is the pod's IP (status.podIP), not localhost."""
    objs = render("pool-groups")
    scheduler = container(objs, "minedraft-group", "scheduler")
    entries = {e["name"]: e for e in scheduler["env"]}
    assert entries["POD_IP"]["valueFrom"] == {"fieldRef": {"fieldPath": "status.podIP"}}
    names = [e["name"] for e in scheduler["env"]]
    assert names.index("POD_IP") < names.index("MINEDRAFT_VERIFIER")  # $(POD_IP) expands only from above
    env = process_env(objs, "minedraft-group", "scheduler", pod_ip="10.4.0.9")
    assert env["MINEDRAFT_VERIFIER"] == "10.4.0.9:50061"
    # engineGroups 1: the verifier's headless Service, which every member resolves
    data = one(render("pool"), "ConfigMap", "minedraft-engine")["data"]
    assert data["MINEDRAFT_VERIFIER"] == "minedraft-verifier.default.svc:50061"
    # without a pool nothing changed: localhost
    plain = process_env(render(GROUPS), "minedraft-group", "scheduler")
    assert (plain["MINEDRAFT_VERIFIER"], plain["MINEDRAFT_DRAFTER"]) == ("127.0.0.1:50061", "127.0.0.1:50062")


@pytest.mark.parametrize(("name", "scheduler"), [("pool", "minedraft-scheduler"), ("pool-groups", "minedraft-group")])
def test_the_services_read_the_rendered_pool_settings(name: str, scheduler: str, monkeypatch) -> None:
    """The schedulers' and the members' command lines and environment, parsed by the real CLI."""
    if not hasattr(serve_cli, "PoolMembership"):
        pytest.skip("the runtime's pool settings (--pool-groups, --drafter-pool) are not in this checkout")
    objs = render(name)
    for deployment, container_name in ((scheduler, "scheduler"), ("minedraft-drafter-pool", "drafter")):
        for key in [k for k in os.environ if k.startswith("MINEDRAFT_")]:
            monkeypatch.delenv(key)
        for key, value in process_env(objs, deployment, container_name).items():
            monkeypatch.setenv(key, value)
        args = build_parser().parse_args(container(objs, deployment, container_name)["args"])
        assert parsed_engine_config(args).speculative_config is not None
        if container_name == "scheduler":
            workers = model_from_args(args, serve_cli.WorkerAddresses)
            assert workers.drafter_pool == ["minedraft-drafter-pool.default.svc:50062"]
        else:
            assert model_from_args(args, serve_cli.PoolMembership).pool_groups == 4


def test_a_long_release_name_keeps_the_pool_service_a_dns_label() -> None:
    objs = render({**POOL, "fullnameOverride": "x" * 52})
    for obj in objs:
        if "drafter-pool" in obj["metadata"]["name"]:
            assert len(obj["metadata"]["name"]) <= 63 and obj["metadata"]["name"].endswith("-drafter-pool")
    service = next(o for o in find(objs, "Service") if o["metadata"]["name"].endswith("-drafter-pool"))
    env = {e["name"]: e.get("value") for e in container(objs, "x" * 52 + "-scheduler", "scheduler")["env"]}
    assert env["MINEDRAFT_DRAFTER_POOL"].startswith(service["metadata"]["name"] + ".default.svc:")


def test_the_pool_rolls_with_the_engine_config_not_with_a_group_s_workers() -> None:
    def checksum(values: dict) -> str:
        template = one(render(values), "Deployment", "minedraft-drafter-pool")["spec"]["template"]
        return template["metadata"]["annotations"]["minedraft/drafter-pool"]

    base = checksum(POOL)
    assert checksum({**POOL, "verifier": {"resources": {"requests": {"cpu": "16"}}}}) == base
    assert checksum({**POOL, "drafterPool": {"replicas": 3}}) == base  # a size change is no restart
    assert checksum({**POOL, "speculativeConfig": {"num_speculative_tokens": 6}}) != base
    assert checksum({**POOL, "drafterPool": {"replicas": 2, "poolGroups": 8}}) != base


# --- PodDisruptionBudget and KEDA ----------------------------------------------------------------------------


@pytest.mark.parametrize("name", ["pool", "pool-groups"])
def test_the_pool_has_a_disruption_budget_of_one_member(name: str) -> None:
    objs = render(name)
    budget = one(objs, "PodDisruptionBudget", "minedraft-drafter-pool")
    assert budget["spec"]["maxUnavailable"] == 1
    assert budget["spec"]["unhealthyPodEvictionPolicy"] == "AlwaysAllow"
    labels = one(objs, "Deployment", "minedraft-drafter-pool")["spec"]["template"]["metadata"]["labels"]
    assert budget["spec"]["selector"]["matchLabels"].items() <= labels.items()
    assert not find(render("pool-no-pdb-policy"), "PodDisruptionBudget", "minedraft-drafter-pool")
    two = render({**POOL, "drafterPool": {"replicas": 4, "podDisruptionBudget": {"maxUnavailable": 2}}})
    assert one(two, "PodDisruptionBudget", "minedraft-drafter-pool")["spec"]["maxUnavailable"] == 2


@pytest.mark.parametrize(("name", "service"), [("pool-scaled", "minedraft-scheduler"),
                                                ("pool-groups-scaled", "minedraft-groups")])  # fmt: skip
def test_keda_scales_the_pool_on_its_queue(name: str, service: str) -> None:
    objs = render(name)
    scaled = one(objs, "ScaledObject", "minedraft-drafter-pool")
    assert scaled["apiVersion"] == "keda.sh/v1alpha1"
    spec = scaled["spec"]
    assert spec["scaleTargetRef"] == {"apiVersion": "apps/v1", "kind": "Deployment", "name": "minedraft-drafter-pool"}
    assert (spec["minReplicaCount"], spec["maxReplicaCount"]) == (2, 5)
    assert (spec["pollingInterval"], spec["cooldownPeriod"]) == (30, 300)
    (trigger,) = spec["triggers"]
    assert trigger["type"] == "prometheus"
    assert trigger["metadata"] == {
        "serverAddress": "http://prometheus-operated.monitoring.svc:9090",
        "query": f'sum(minedraft:drafter_pool_queue{{namespace="default",service="{service}"}})',
        "threshold": "6",  # KEDA reads trigger metadata as strings
    }
    assert set(spec) <= {"scaleTargetRef", "minReplicaCount", "maxReplicaCount", "pollingInterval", "cooldownPeriod",
                         "triggers"}  # fmt: skip
    # KEDA owns the member count: the Deployment leaves it out, so an upgrade does not reset it
    assert "replicas" not in one(objs, "Deployment", "minedraft-drafter-pool")["spec"]
    # the series come from the schedulers' Service, which the ServiceMonitor scrapes
    monitor = one(objs, "ServiceMonitor", "minedraft-scheduler")
    scraped = one(objs, "Service", service)["metadata"]["labels"]
    assert monitor["spec"]["selector"]["matchLabels"].items() <= scraped.items()
    assert not find(render("pool"), "ScaledObject", "minedraft-drafter-pool")


# --- NetworkPolicy -------------------------------------------------------------------------------------------


@pytest.mark.parametrize(("name", "peers"), [("pool", ["scheduler", "verifier"]), ("pool-groups", ["group"])])
def test_only_the_groups_reach_the_pool_and_only_its_port(name: str, peers: list[str]) -> None:
    objs = render(name)
    policy = one(objs, "NetworkPolicy", "minedraft-drafter-pool")
    labels = one(objs, "Deployment", "minedraft-drafter-pool")["spec"]["template"]["metadata"]["labels"]
    assert policy["spec"]["podSelector"]["matchLabels"].items() <= labels.items()
    assert policy["spec"]["policyTypes"] == ["Ingress"]
    (rule,) = policy["spec"]["ingress"]  # nothing else reaches a member, on any port
    assert [next(c for c in peers if _selects(p, c)) for p in rule["from"]] == peers
    assert all(set(p) == {"podSelector"} for p in rule["from"])  # pods of this release, no namespace or IP block
    assert rule["ports"] == [{"port": 50062, "protocol": "TCP"}]
    for peer in peers:  # the peers named are pods this release runs
        owner = "minedraft-group" if peer == "group" else f"minedraft-{peer}"
        pod_labels = one(objs, "Deployment", owner)["spec"]["template"]["metadata"]["labels"]
        selector = next(p for p in rule["from"] if _selects(p, peer))["podSelector"]["matchLabels"]
        assert selector.items() <= pod_labels.items()


def test_members_reach_the_verifier_grpc_port_only() -> None:
    """engineGroups 1: the verifier's policy lets the scheduler and the members reach its gRPC port; with no
    drafter in its world nobody gets the other ports (no rendezvous, no NCCL/gloo from another pod)."""
    objs = render("pool")
    rules = one(objs, "NetworkPolicy", "minedraft-verifier")["spec"]["ingress"]
    assert [[_selects(p, c) for c in ("scheduler", "drafter-pool")] for r in rules for p in r["from"]] == [
        [True, False], [False, True]]  # fmt: skip
    assert all(rule["ports"] == [{"port": 50061, "protocol": "TCP"}] for rule in rules)
    assert not find(objs, "NetworkPolicy", "minedraft-drafter")


def test_group_pods_let_the_members_reach_the_verifier_and_nobody_the_workers() -> None:
    """engineGroups > 1: the group pods' policy. Clients reach the scheduler's ports; with a pool its members the
    verifier's gRPC port; the workers' other ports nobody (their own containers talk over localhost)."""
    objs = render("pool-groups")
    policy = one(objs, "NetworkPolicy", "minedraft-group")
    labels = one(objs, "Deployment", "minedraft-group")["spec"]["template"]["metadata"]["labels"]
    assert policy["spec"]["podSelector"]["matchLabels"].items() <= labels.items()
    clients, metrics, pool = policy["spec"]["ingress"]
    assert clients == {"ports": [{"port": 50051, "protocol": "TCP"}, {"port": 8000, "protocol": "TCP"}]}
    assert metrics == {"ports": [{"port": 7450, "protocol": "TCP"}]}
    assert [_selects(p, "drafter-pool") for p in pool["from"]] == [True]
    assert pool["ports"] == [{"port": 50061, "protocol": "TCP"}]
    # without a pool the same policy, less the members' rule; clientFrom restricts the scheduler's ports
    restricted = {**GROUPS, "networkPolicy": {"clientFrom": [{"namespaceSelector": {"matchLabels": {"t": "a"}}}]}}
    rules = one(render(restricted), "NetworkPolicy", "minedraft-group")["spec"]["ingress"]
    assert len(rules) == 2 and rules[0]["from"] == restricted["networkPolicy"]["clientFrom"]
    assert not find(render("pool-no-pdb-policy"), "NetworkPolicy")


# --- refusals ------------------------------------------------------------------------------------------------

LORA = {"engine": {"enableLora": True, "loraModules": [{"name": "sql", "path": "sql"}]},
        "loraAdapters": {"volume": {"type": "existingClaim", "existingClaim": "adapters"}}}  # fmt: skip
RUNTIME_LORA = {"engine": {"enableLora": True, "allowRuntimeLoraUpdating": True},
                "loraAdapters": {"volume": {"type": "existingClaim", "existingClaim": "adapters"}}}  # fmt: skip
EAGLE3 = {"speculativeConfig": {"method": "eagle3"}}
EAGLE = {"speculativeConfig": {"method": "eagle"}, "models": CLAIM}


@pytest.mark.parametrize(
    ("values", "message"),
    [
        (EAGLE3, "drafterPool cannot serve speculativeConfig.method eagle3: an EAGLE head reads the target's "
                 "hidden states every step"),
        (EAGLE, "drafterPool cannot serve speculativeConfig.method eagle:"),
        (LORA, "a drafter pool does not serve LoRA adapters"),
        (RUNTIME_LORA, "a drafter pool does not serve LoRA adapters"),
        ({"speculativeConfig": None}, "drafterPool.replicas is 2 but speculativeConfig is null"),
        ({"engineGroups": 9}, r"drafterPool serves at most 8 engine groups \(2 members x drafterPool.poolGroups 4\) "
                              "but the release runs up to 9"),
        ({"engineGroups": 3, "autoscaling": {"enabled": True, "maxGroups": 12},
          "drafterPool": {"autoscaling": {"enabled": True, "maxReplicas": 2}}},
         "at most 8 engine groups .* up to 12: .* raise drafterPool.autoscaling.maxReplicas"),
        ({"drafterPool": {"autoscaling": {"enabled": True, "minReplicas": 3, "maxReplicas": 2}}},
         r"minReplicas \(3\) is above drafterPool.autoscaling.maxReplicas \(2\)"),
        ({"drafterPool": {"autoscaling": {"enabled": True}}, "scheduler": {"metricsPort": 0}},
         "drafterPool.autoscaling reads the schedulers' minedraft:drafter_pool_queue"),
        ({"drafterPool": {"terminationGracePeriodSeconds": 30}},
         r"drafterPool.terminationGracePeriodSeconds \(30\) must be at least"),
    ],
)  # fmt: skip
def test_what_a_pool_cannot_do_fails_the_render(values: dict, message: str) -> None:
    with pytest.raises(helm.HelmRenderError, match=message):
        renderer.render(gpu_ok(renderer.merge(POOL, values)))
    if "drafterPool" not in json.dumps(values) and "engineGroups" not in values:  # fine without a pool
        assert renderer.render(gpu_ok(values))


@pytest.mark.parametrize("values", [EAGLE3, LORA, RUNTIME_LORA])
def test_the_runtime_refuses_what_the_chart_refuses(values: dict) -> None:
    """The same configurations, as the engine config the chart renders, fail the runtime's own pool check."""
    pool = pytest.importorskip("minedraft.pool", reason="the runtime's pool is not in this checkout")
    data = one(render(values), "ConfigMap", "minedraft-engine")["data"]
    config = EngineConfig.model_validate(json.loads(data["MINEDRAFT_ENGINE_CONFIG"]))
    with pytest.raises(ValueError, match="EAGLE head|does not serve LoRA adapters"):
        pool.check_poolable(config)


@pytest.mark.parametrize(
    ("values", "message"),
    [
        ({"drafterPool": {"poolGroups": 0}}, "at '/drafterPool/poolGroups': minimum: got 0, want 1"),
        ({"drafterPool": {"replicas": -1}}, "at '/drafterPool/replicas': minimum: got -1, want 0"),
        ({"drafterPool": {"members": 2}}, "'members' not allowed"),
        ({"drafterPool": {"autoscaling": {"minReplicas": 0}}}, "at '/drafterPool/autoscaling/minReplicas'"),
        ({"drafterPool": {"podDisruptionBudget": {"maxUnavailable": 0}}},
         "at '/drafterPool/podDisruptionBudget/maxUnavailable'"),
        ({"drafterPool": {"withoutModel": {"gpus": 1}}}, "'gpus' not allowed"),
    ],
)  # fmt: skip
def test_schema_rejects_bad_pool_values(values: dict, message: str) -> None:
    with pytest.raises(helm.HelmValuesError) as error:
        renderer.render(gpu_ok(values))
    assert message in str(error.value)


# --- the capacity table --------------------------------------------------------------------------------------


def test_the_capacity_table_in_the_docs_is_what_the_script_prints(capsys) -> None:
    """docs/kubernetes.md shows `python benchmarks/pool_capacity.py` as it prints today (a model: no GPU runs)."""
    capacity = _load("pool_capacity", ROOT / "benchmarks" / "pool_capacity.py")
    assert capacity.main([]) == 0
    printed = capsys.readouterr().out.strip()
    assert printed in (ROOT / "docs" / "kubernetes.md").read_text()
    # the model's sizes are Qwen3's: the parameter counts agree with the model cards'
    for model in [capacity.TARGET, *capacity.DRAFTS]:
        assert f"{model.params() / 1e9:.1f}B" == model.card_params, model.name
    # what a shared forward buys: never fewer groups than drafting them one at a time
    for draft in capacity.DRAFTS:
        for batch in (1, 8, 32, 64):
            c = capacity.capacity(draft, batch, 4, 1024, 4)
            assert c.shared >= c.alone and c.groups <= c.memory
