"""The chart's gateway, engine groups and autoscaling: rendered with the Helm library, every object strictly
validated against the Kubernetes schemas (KEDA's ScaledObject, a CRD, checked field by field)."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path
from typing import Any

import helm_python as helm
import jsonschema
import kubernetes_validate
import pytest
import yaml

from minedraft.cli import build_parser

ROOT = Path(__file__).resolve().parents[1]
KUBE_VERSION = "1.35.0"


def _load_renderer():
    spec = importlib.util.spec_from_file_location("render_manifests", ROOT / "scripts" / "render_manifests.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules["render_manifests"] = module
    spec.loader.exec_module(module)
    return module


renderer = _load_renderer()


def gpu_ok(values: dict[str, Any]) -> dict[str, Any]:
    """`values` with the bundled pair allowed on GPUs: these tests render the chart's structure with it (the
    refusal itself is tested in test_chart.py)."""
    return renderer.merge({"models": {"allowBundledOnGpus": True}}, values)


GROUPS = {"engineGroups": 3}
AUTOSCALED = {"engineGroups": 2, "autoscaling": {"enabled": True, "maxGroups": 6, "waitingRequestsPerGroup": 4},
              "serviceMonitor": {"enabled": True}, "podDisruptionBudget": {"enabled": True}}  # fmt: skip
COMBINATIONS: dict[str, dict[str, Any]] = {
    "default": {},
    "cpu": renderer.profile_values("cpu"),
    "groups": GROUPS,
    "groups-cpu": {**renderer.profile_values("cpu"), **GROUPS},
    "groups-autoregressive": {**GROUPS, "speculativeConfig": None},
    "groups-claim-download": {
        **GROUPS,
        "models": {
            "target": "t",
            "draft": "d",
            "volume": {"type": "createClaim", "accessModes": ["ReadWriteMany"]},
            "download": {"enabled": True, "target": "org/t", "draft": "org/d"},
        },
    },  # fmt: skip
    "autoscaled": AUTOSCALED,
    "no-gateway": {"gateway": {"enabled": False}},
    "keys-tls": {"apiKeys": {"existingSecret": "keys"}, "tls": {"existingSecret": "certs"}},
    "groups-keys-tls": {**GROUPS, "apiKeys": {"existingSecret": "keys"}, "tls": {"existingSecret": "certs"}},
    "inference-pool": {"inferencePool": {"enabled": True}},
    "groups-inference-pool": {**GROUPS, "inferencePool": {"enabled": True}},
}
CRDS = ("ServiceMonitor", "ScaledObject", "InferencePool", "HTTPRoute")  # no schema in kubernetes-validate


def render(name: str) -> list[dict[str, Any]]:
    return [m.obj for m in renderer.render(gpu_ok(COMBINATIONS[name]))]


def one(objs: list[dict], kind: str, name: str) -> dict:
    found = [o for o in objs if o["kind"] == kind and o["metadata"]["name"] == name]
    assert len(found) == 1, f"expected one {kind} {name}, got {len(found)}"
    return found[0]


@pytest.mark.parametrize("name", sorted(COMBINATIONS))
def test_every_object_validates(name: str) -> None:
    for obj in render(name):
        if obj["kind"] in CRDS:  # checked below
            continue
        try:
            kubernetes_validate.validate(obj, KUBE_VERSION, strict=True)
        except kubernetes_validate.ValidationError as exc:
            pytest.fail(f"{obj['kind']} {obj['metadata']['name']}: {exc.message}")


@pytest.mark.parametrize("values", [COMBINATIONS["groups"], AUTOSCALED], ids=["groups", "autoscaled"])
def test_lint_is_clean(values) -> None:
    report = helm.lint(renderer.CHART_DIR, values=gpu_ok(values), strict=True, kube_version=f"v{KUBE_VERSION}")
    assert not [m for m in report["messages"] if m["severity"] >= 2] + report["errors"]


def _gateway_args(objs: list[dict]) -> dict[str, str]:
    container = one(objs, "Deployment", "minedraft-gateway")["spec"]["template"]["spec"]["containers"][0]
    args = container["args"]
    assert args[0] == "gateway"
    parsed = build_parser().parse_args(args)  # the rendered command line is one the CLI accepts
    return vars(parsed)


def test_gateway_by_default_in_front_of_the_one_group() -> None:
    objs = render("default")
    gateway = one(objs, "Deployment", "minedraft-gateway")
    assert gateway["spec"]["replicas"] == 2
    spec = gateway["spec"]["template"]["spec"]
    assert spec["serviceAccountName"] == "minedraft-gateway" and spec["automountServiceAccountToken"] is True
    assert spec["containers"][0]["readinessProbe"]["grpc"]["port"] == 50051
    args = _gateway_args(objs)
    assert (args["k8s_service"], args["namespace"], args["port_name"]) == ("minedraft-scheduler", "default", "grpc")
    assert float(args["placement_timeout"]) == 60  # the chart's gateway.placementTimeoutSeconds
    scheduler_ports = {p["name"] for p in one(objs, "Service", "minedraft-scheduler")["spec"]["ports"]}
    assert "grpc" in scheduler_ports  # the port the gateway looks for in the EndpointSlices
    service = one(objs, "Service", "minedraft-gateway")
    assert service["spec"]["selector"]["app.kubernetes.io/component"] == "gateway"
    assert service["spec"]["ports"][0]["port"] == 50051  # what `minedraft bench --k8s` forwards to
    budget = one(objs, "PodDisruptionBudget", "minedraft-gateway")
    assert budget["spec"]["maxUnavailable"] == 1
    role = one(objs, "Role", "minedraft-gateway")
    assert role["rules"] == [{"apiGroups": ["discovery.k8s.io"], "resources": ["endpointslices"],
                              "verbs": ["list", "watch"]}]  # fmt: skip
    binding = one(objs, "RoleBinding", "minedraft-gateway")
    assert binding["subjects"][0]["name"] == "minedraft-gateway" and binding["roleRef"]["name"] == "minedraft-gateway"
    assert not [o for o in objs if o["metadata"]["name"] in ("minedraft-group", "minedraft-groups")]
    assert build_parser().parse_args(["bench", "--k8s"]).service == "minedraft-gateway"


def test_engine_groups_are_pods_spread_over_nodes() -> None:
    objs = render("groups")
    names = {(o["kind"], o["metadata"]["name"]) for o in objs}
    assert not names & {("Deployment", "minedraft-scheduler"), ("Deployment", "minedraft-verifier"),
                        ("Deployment", "minedraft-drafter")}  # fmt: skip
    group = one(objs, "Deployment", "minedraft-group")
    assert group["spec"]["replicas"] == 3
    assert group["spec"]["strategy"]["rollingUpdate"] == {"maxSurge": 0, "maxUnavailable": 1}
    spec = group["spec"]["template"]["spec"]
    containers = {c["name"]: c for c in spec["containers"]}
    assert list(containers) == ["scheduler", "verifier", "drafter"]
    env = {e["name"]: e.get("value") for e in containers["scheduler"]["env"]}
    assert env["MINEDRAFT_VERIFIER"] == "127.0.0.1:50061" and env["MINEDRAFT_DRAFTER"] == "127.0.0.1:50062"
    for worker in ("verifier", "drafter"):
        assert {e["name"]: e.get("value") for e in containers[worker]["env"]}["MINEDRAFT_DIST_ADDR"] == "127.0.0.1"
    assert containers["verifier"]["resources"]["limits"]["nvidia.com/gpu"] == 4
    assert containers["drafter"]["resources"]["limits"]["nvidia.com/gpu"] == 1
    assert "nvidia.com/gpu" not in containers["scheduler"]["resources"].get("limits", {})
    spread = spec["affinity"]["podAntiAffinity"]["preferredDuringSchedulingIgnoredDuringExecution"][0]
    assert spread["podAffinityTerm"]["topologyKey"] == "kubernetes.io/hostname"
    assert spread["podAffinityTerm"]["labelSelector"]["matchLabels"]["app.kubernetes.io/component"] == "group"
    service = one(objs, "Service", "minedraft-groups")
    assert service["spec"]["clusterIP"] == "None"
    assert {p["name"] for p in service["spec"]["ports"]} == {"grpc", "metrics"}
    assert _gateway_args(objs)["k8s_service"] == "minedraft-groups"


def test_groups_without_speculation_have_no_drafter_and_cpu_groups_no_gpu() -> None:
    containers = one(render("groups-autoregressive"), "Deployment", "minedraft-group")["spec"]["template"]["spec"]
    assert [c["name"] for c in containers["containers"]] == ["scheduler", "verifier"]
    env = {e["name"] for e in containers["containers"][0]["env"]}
    assert "MINEDRAFT_DRAFTER" not in env
    cpu = one(render("groups-cpu"), "Deployment", "minedraft-group")["spec"]["template"]["spec"]
    assert not [c for c in cpu["containers"] if "nvidia.com/gpu" in c["resources"].get("limits", {})]


def test_groups_download_their_models_and_the_gateway_its_tokenizer() -> None:
    objs = render("groups-claim-download")
    group = one(objs, "Deployment", "minedraft-group")["spec"]["template"]["spec"]
    assert [c["name"] for c in group["initContainers"]] == ["download-target", "download-draft"]
    gateway = one(objs, "Deployment", "minedraft-gateway")["spec"]["template"]["spec"]
    assert [c["name"] for c in gateway["initContainers"]] == ["download-tokenizer"]
    assert _gateway_args(objs)["tokenizer"] == "/models/t"


def test_autoscaling_is_a_keda_scaled_object_on_queue_depth() -> None:
    objs = render("autoscaled")
    scaled = one(objs, "ScaledObject", "minedraft-group")
    assert scaled["apiVersion"] == "keda.sh/v1alpha1"
    spec = scaled["spec"]
    target = one(objs, "Deployment", spec["scaleTargetRef"]["name"])  # scales the engine-group Deployment
    assert target["metadata"]["name"] == "minedraft-group" and spec["scaleTargetRef"]["kind"] == "Deployment"
    assert (spec["minReplicaCount"], spec["maxReplicaCount"]) == (1, 6)
    (trigger,) = spec["triggers"]
    assert trigger["type"] == "prometheus"
    assert trigger["metadata"]["query"] == (
        'sum(minedraft:num_requests_waiting{namespace="default",service="minedraft-groups"})'
    )
    assert trigger["metadata"]["threshold"] == "4"  # KEDA reads trigger metadata as strings
    assert set(spec) <= {"scaleTargetRef", "minReplicaCount", "maxReplicaCount", "pollingInterval",
                         "cooldownPeriod", "triggers"}  # fmt: skip
    # the metric is scraped from the groups' Service
    monitor = one(objs, "ServiceMonitor", "minedraft-scheduler")
    groups = one(objs, "Service", "minedraft-groups")
    assert monitor["spec"]["selector"]["matchLabels"].items() <= groups["metadata"]["labels"].items()
    assert not [o for o in render("default") if o["kind"] == "ScaledObject"]  # off by default
    budget = one(objs, "PodDisruptionBudget", "minedraft-group")  # drains take one group at a time
    assert {b["metadata"]["name"] for b in objs if b["kind"] == "PodDisruptionBudget"} == {
        "minedraft-group", "minedraft-gateway",
    }  # fmt: skip
    assert budget["spec"]["maxUnavailable"] == 1
    assert budget["spec"]["selector"]["matchLabels"].items() <= target["spec"]["template"]["metadata"]["labels"].items()


def test_cpu_profile_keeps_the_gateway_on_the_development_nodes() -> None:
    for name in ("cpu", "groups-cpu"):
        spec = one(render(name), "Deployment", "minedraft-gateway")["spec"]["template"]["spec"]
        assert spec["nodeSelector"] == {"minedraft/pool": "cpu"}
        assert spec["containers"][0]["resources"]["requests"] == {"cpu": "100m", "memory": "256Mi"}


def test_the_gateway_can_be_switched_off() -> None:
    objs = render("no-gateway")
    assert not [o for o in objs if "gateway" in o["metadata"]["name"]]


@pytest.mark.parametrize(
    ("values", "message"),
    [
        ({"engineGroups": 0}, "at '/engineGroups': minimum: got 0, want 1"),
        ({"gateway": {"replicas": 0}}, "at '/gateway/replicas': minimum: got 0, want 1"),
        ({"gateway": {"port": "x"}}, "at '/gateway/port': got string, want integer"),
        ({"autoscaling": {"minGroups": 0}}, "at '/autoscaling/minGroups'"),
        ({"autoscaling": {"scaler": "hpa"}}, "'scaler' not allowed"),
    ],
)
def test_schema_rejects_bad_values(values: dict, message: str) -> None:
    with pytest.raises(helm.HelmValuesError) as error:
        renderer.render(gpu_ok(values))
    assert message in str(error.value)


def test_autoscaling_needs_groups() -> None:
    with pytest.raises(helm.HelmError, match="set engineGroups to 2 or more"):
        renderer.render(gpu_ok({"autoscaling": {"enabled": True}}))


def _container(objs: list[dict], name: str, container: str) -> tuple[dict, dict]:
    """(pod spec, the named container) of Deployment `name`."""
    spec = one(objs, "Deployment", name)["spec"]["template"]["spec"]
    return spec, next(c for c in spec["containers"] if c["name"] == container)


def _secret_volume(spec: dict, mount_path: str, container: dict) -> dict:
    """The Secret volume a container mounts at `mount_path`."""
    name = next(m["name"] for m in container["volumeMounts"] if m["mountPath"] == mount_path)
    return next(v for v in spec["volumes"] if v["name"] == name)["secret"]


@pytest.mark.parametrize(
    ("name", "scheduler"), [("keys-tls", "minedraft-scheduler"), ("groups-keys-tls", "minedraft-group")]
)
def test_the_gateway_checks_the_keys_and_reaches_the_schedulers_with_its_own(name: str, scheduler: str) -> None:
    """The clients' keys are checked at the gateway; the schedulers accept the gateway's own key, a file from
    the same Secret; the gateway serves TLS on gRPC and HTTP, probed over HTTPS."""
    objs = render(name)
    spec, gateway = _container(objs, "minedraft-gateway", "gateway")
    args = _gateway_args(objs)
    env = {e["name"]: e for e in gateway["env"]}
    assert env["MINEDRAFT_API_KEYS"]["valueFrom"]["secretKeyRef"] == {"name": "keys", "key": "api-keys"}
    key_file = args["backend_api_key_file"]
    assert _secret_volume(spec, str(Path(key_file).parent), gateway) == {
        "secretName": "keys",
        "defaultMode": 0o440,
        "items": [{"key": "gateway-key", "path": Path(key_file).name}],
    }
    assert env["MINEDRAFT_TLS_CERT"]["value"] == "/etc/minedraft/tls/tls.crt"
    assert _secret_volume(spec, "/etc/minedraft/tls", gateway)["secretName"] == "certs"
    assert int(args["http_port"]) == 8000
    assert gateway["readinessProbe"]["httpGet"] == {"path": "/health", "port": "http", "scheme": "HTTPS"}
    ports = {p["name"]: p for p in one(objs, "Service", "minedraft-gateway")["spec"]["ports"]}
    assert (ports["http"]["port"], ports["http"]["appProtocol"], ports["grpc"]["port"]) == (8000, "https", 50051)
    pod, container = _container(objs, scheduler, "scheduler")
    scheduler_args = build_parser().parse_args(container["args"])
    assert scheduler_args.api_key_file == [key_file]
    assert _secret_volume(pod, str(Path(key_file).parent), container)["items"] == [
        {"key": "gateway-key", "path": "key"}
    ]
    if name == "keys-tls":  # the one scheduler serves TLS: the gateway trusts the Secret's CA, by the Service's name
        assert (args["backend_tls_ca"], args["backend_tls_server_name"]) == ("/etc/minedraft/tls/ca.crt",
                                                                             "minedraft-scheduler")  # fmt: skip
    else:  # the groups' schedulers serve the gateway in plaintext inside the cluster
        assert args["backend_tls_ca"] is None


def test_routing_policy_and_per_request_speculation_metrics_reach_the_gateway() -> None:
    """`gateway.routingPolicy` and `scheduler.perRequestSpecDecodeMetrics` (the public API setting the gateway
    shares with the schedulers) become its flags; by default least-work and no per-request metrics."""
    args = _gateway_args(render("default"))
    assert (args["routing_policy"], args["per_request_spec_decode_metrics"]) == ("least-work", None)
    for policy, metrics in (("prefix", "summary"), ("predicted", "detailed")):
        values = {**GROUPS, "gateway": {"routingPolicy": policy},
                  "scheduler": {"perRequestSpecDecodeMetrics": metrics}}  # fmt: skip
        objs = [m.obj for m in renderer.render(gpu_ok(values))]
        assert (_gateway_args(objs)["routing_policy"], _gateway_args(objs)["per_request_spec_decode_metrics"]) == (
            policy, metrics)  # fmt: skip
        data = one(objs, "ConfigMap", "minedraft-engine")["data"]
        assert data["MINEDRAFT_PER_REQUEST_SPEC_DECODE_METRICS"] == metrics  # the groups' schedulers too
    for values in ({"gateway": {"routingPolicy": "random"}}, {"scheduler": {"perRequestSpecDecodeMetrics": "all"}}):
        with pytest.raises(helm.HelmValuesError, match="value must be one of"):
            renderer.render(gpu_ok(values))


def test_the_gateway_serves_http_by_default() -> None:
    objs = render("default")
    assert int(_gateway_args(objs)["http_port"]) == 8000
    ports = {p["name"]: p["port"] for p in one(objs, "Service", "minedraft-gateway")["spec"]["ports"]}
    assert ports == {"grpc": 50051, "http": 8000}


@pytest.mark.parametrize(
    ("values", "message"),
    [
        ({"tls": {"existingSecret": "c"}, "gateway": {"httpPort": 0}}, "TLS needs gateway.httpPort"),
        ({"apiKeys": {"existingSecret": "k", "gatewayKey": ""}}, "needs apiKeys.gatewayKey"),
    ],
)
def test_keys_and_tls_refuse_what_cannot_work(values: dict, message: str) -> None:
    with pytest.raises(helm.HelmError, match=message):
        renderer.render(gpu_ok(values))


def _strict(schema: dict[str, Any]) -> dict[str, Any]:
    """A CRD's structural schema with unknown fields as errors (the API server would drop them silently)."""
    schema = {k: _strict(v) if isinstance(v, dict) else v for k, v in schema.items()}
    if "properties" in schema:
        schema["properties"] = {k: _strict(v) for k, v in schema["properties"].items()}
        schema.setdefault("additionalProperties", False)  # (metadata has no properties here: any ObjectMeta)
    return schema


def _inference_pool_schema() -> dict[str, Any]:
    crd = yaml.safe_load((ROOT / "tests" / "schemas" / "inference.networking.k8s.io_inferencepools.yaml").read_text())
    (version,) = [v for v in crd["spec"]["versions"] if v["name"] == "v1"]
    return _strict(version["schema"]["openAPIV3Schema"])


@pytest.mark.parametrize("name", ["inference-pool", "groups-inference-pool"])
def test_inference_pool_fronts_the_schedulers_and_validates_against_the_extension_crd(name: str) -> None:
    objs = render(name)
    pool = one(objs, "InferencePool", "minedraft")
    assert pool["apiVersion"] == "inference.networking.k8s.io/v1"
    jsonschema.validate(pool, _inference_pool_schema())
    spec = pool["spec"]
    # the CRD's CEL rules, which a JSON schema cannot say: a Service reference has a port, ports are unique
    assert spec["endpointPickerRef"].get("kind", "Service") != "Service" or "port" in spec["endpointPickerRef"]
    assert len({p["number"] for p in spec["targetPorts"]}) == len(spec["targetPorts"])
    # the pool's pods are the ones that run a scheduler, on its OpenAI HTTP port
    scheduler = one(objs, "Deployment", "minedraft-group" if name.startswith("groups") else "minedraft-scheduler")
    pod = scheduler["spec"]["template"]
    assert spec["selector"]["matchLabels"].items() <= pod["metadata"]["labels"].items()
    assert spec["targetPorts"] == [{"number": 8000}]  # scheduler.httpPort: it serves /v1 and /metrics
    # the endpoint picker behind the reference, and the route that sends the Gateway's traffic to the pool
    epp = one(objs, "Service", spec["endpointPickerRef"]["name"])
    assert spec["endpointPickerRef"]["port"]["number"] in [p["port"] for p in epp["spec"]["ports"]]
    picker = one(objs, "Deployment", "minedraft-epp")["spec"]["template"]
    assert epp["spec"]["selector"].items() <= picker["metadata"]["labels"].items()
    args = picker["spec"]["containers"][0]["args"]
    assert args[args.index("--pool-name") + 1] == "minedraft"
    route = one(objs, "HTTPRoute", "minedraft")
    assert route["apiVersion"] == "gateway.networking.k8s.io/v1"
    (rule,) = route["spec"]["rules"]
    pool_ref = {"group": "inference.networking.k8s.io", "kind": "InferencePool", "name": "minedraft"}
    assert rule["backendRefs"] == [pool_ref]
    assert route["spec"]["parentRefs"][0]["name"] == "inference-gateway"
    assert not [o for o in render("default") if o["kind"] in ("InferencePool", "HTTPRoute")]  # off by default


def test_the_vendored_crd_rejects_what_the_api_server_would() -> None:
    schema = _inference_pool_schema()
    good = one(render("inference-pool"), "InferencePool", "minedraft")
    for broken in ({"targetPorts": []}, {"selector": {}}, {"endpointPickerRef": {"name": "e", "failureMode": "Maybe"}},
                   {"unknown": 1}):  # fmt: skip
        with pytest.raises(jsonschema.ValidationError):
            jsonschema.validate({**good, "spec": {**good["spec"], **broken}}, schema)
