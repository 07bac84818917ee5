"""``KubernetesProvider`` against a stand-in API server.

No cluster is available here, so each test serves the few endpoints the provider uses (the
Deployment, its ``scale`` subresource, the pod list) from ``http.server`` on loopback, with the
answers and errors a real API server gives, records every request, and checks what the provider
sent and what it made of the answers. The in-cluster test does the same over TLS with a CA and
token laid out as a service-account mount.
"""

import json
import shutil
import ssl
import subprocess
import threading
import urllib.parse
from datetime import UTC, datetime
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

from services.autoscaler import kubernetes_provider
from services.autoscaler.kubernetes_provider import (
    SCALE_REASON_ANNOTATION,
    KubernetesApi,
    KubernetesApiError,
    KubernetesProvider,
    label_selector,
)
from services.autoscaler.provider import FleetState

NOW = datetime(2025, 6, 1, 12, 0, 0, tzinfo=UTC).timestamp()
DEPLOYMENT_PATH = "/apis/apps/v1/namespaces/strata/deployments/strata-engine"
PODS_PATH = "/api/v1/namespaces/strata/pods"


def iso(seconds_ago: float) -> str:
    return datetime.fromtimestamp(NOW - seconds_ago, UTC).strftime("%Y-%m-%dT%H:%M:%SZ")


def pod(name: str, age_s: float, ready: bool | None, **extra) -> dict:
    conditions = [] if ready is None else [{"type": "Ready", "status": "True" if ready else "False"}]
    status = {"phase": extra.pop("phase", "Running"), "conditions": conditions}
    return {"metadata": {"name": name, "creationTimestamp": iso(age_s), **extra}, "status": status}


def deployment(replicas: int, ready: int | None) -> dict:
    status = {"replicas": replicas} | ({"readyReplicas": ready} if ready is not None else {})
    return {"kind": "Deployment", "metadata": {"name": "strata-engine", "namespace": "strata"},
            "spec": {"replicas": replicas, "selector": {"matchLabels": {"app.kubernetes.io/name": "strata-engine"}}},
            "status": status}


def api_status(code: int, reason: str, message: str) -> dict:
    return {"kind": "Status", "apiVersion": "v1", "status": "Failure", "message": message, "reason": reason,
            "code": code}


class FakeApiServer:
    """The endpoints the provider calls, answering from ``self.deployment`` and ``self.pods``;
    ``self.errors[(method, path)] = (code, Status)`` makes one fail; ``self.requests`` records
    (method, path, query, headers, body) of each request."""

    def __init__(self, tls_context: ssl.SSLContext | None = None) -> None:
        self.deployment: dict | None = deployment(1, 1)
        self.pods: list[dict] = []
        self.errors: dict[tuple[str, str], tuple[int, dict]] = {}
        self.requests: list[tuple[str, str, dict, dict, dict | None]] = []
        fake = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *args) -> None:
                pass

            def do_GET(self) -> None:
                fake.handle(self, "GET")

            def do_PATCH(self) -> None:
                fake.handle(self, "PATCH")

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        if tls_context is not None:
            self.server.socket = tls_context.wrap_socket(self.server.socket, server_side=True)
        self.thread = threading.Thread(target=self.server.serve_forever, args=(0.05,), daemon=True)
        self.thread.start()

    @property
    def port(self) -> int:
        return self.server.server_address[1]

    def handle(self, handler: BaseHTTPRequestHandler, method: str) -> None:
        url = urllib.parse.urlsplit(handler.path)
        length = int(handler.headers.get("Content-Length") or 0)
        body = json.loads(handler.rfile.read(length)) if length else None
        self.requests.append((method, url.path, urllib.parse.parse_qs(url.query), dict(handler.headers), body))
        code, answer = self.answer(method, url.path, handler.headers.get("Content-Type"), body)
        payload = json.dumps(answer).encode()
        handler.send_response(code)
        handler.send_header("Content-Type", "application/json")
        handler.send_header("Content-Length", str(len(payload)))
        handler.end_headers()
        handler.wfile.write(payload)

    def answer(self, method: str, path: str, content_type: str | None, body: dict | None) -> tuple[int, dict]:
        if (method, path) in self.errors:
            return self.errors[(method, path)]
        if method == "PATCH" and content_type != "application/merge-patch+json":
            return 415, api_status(415, "UnsupportedMediaType", "the body of the request was in an unknown format")
        if path.startswith(DEPLOYMENT_PATH) and self.deployment is None:
            return 404, api_status(404, "NotFound", 'deployments.apps "strata-engine" not found')
        if (method, path) == ("GET", DEPLOYMENT_PATH):
            return 200, self.deployment
        if (method, path) == ("GET", PODS_PATH):
            return 200, {"kind": "PodList", "items": self.pods}
        if (method, path) == ("PATCH", DEPLOYMENT_PATH + "/scale"):
            self.deployment["spec"]["replicas"] = body["spec"]["replicas"]
            return 200, {"kind": "Scale", "spec": {"replicas": body["spec"]["replicas"]}}
        if (method, path) == ("PATCH", DEPLOYMENT_PATH):
            annotations = self.deployment["metadata"].setdefault("annotations", {})
            annotations.update(body["metadata"]["annotations"])
            return 200, self.deployment
        return 404, api_status(404, "NotFound", f"the server could not find the requested resource ({path})")

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()


@pytest.fixture
def fake():
    server = FakeApiServer()
    yield server
    server.close()


@pytest.fixture
def provider(fake):
    api = KubernetesApi(f"http://127.0.0.1:{fake.port}", token="test-token", timeout_s=5.0)
    return KubernetesProvider("strata-engine", "strata", api, clock=lambda: NOW)


def test_state_counts_replicas_and_the_oldest_pod_still_starting(fake, provider):
    fake.deployment = deployment(replicas=4, ready=1)
    fake.pods = [
        pod("serving", age_s=3600, ready=True),
        pod("loading-weights", age_s=120, ready=False),
        pod("just-scheduled", age_s=30, ready=None),  # no conditions yet
        pod("draining", age_s=7200, ready=False, deletionTimestamp=iso(5)),  # being deleted: not starting
        pod("evicted", age_s=9000, ready=False, phase="Failed"),  # ended: not starting
    ]
    assert provider.state() == FleetState(current=4, ready=1, oldest_starting_s=120.0)
    methods_and_paths = [(method, path) for method, path, *_ in fake.requests]
    assert methods_and_paths == [("GET", DEPLOYMENT_PATH), ("GET", PODS_PATH)]
    _, _, query, headers, _ = fake.requests[1]
    assert query == {"labelSelector": ["app.kubernetes.io/name=strata-engine"]}
    assert all(request[3]["Authorization"] == "Bearer test-token" for request in fake.requests)


def test_state_with_every_pod_ready_or_none_ready_yet(fake, provider):
    fake.deployment = deployment(replicas=2, ready=2)
    fake.pods = [pod("a", age_s=600, ready=True), pod("b", age_s=60, ready=True)]
    assert provider.state() == FleetState(current=2, ready=2, oldest_starting_s=None)
    fake.deployment = deployment(replicas=1, ready=None)  # the API leaves readyReplicas out at 0
    fake.pods = [pod("c", age_s=45, ready=False)]
    assert provider.state() == FleetState(current=1, ready=0, oldest_starting_s=45.0)


def test_scale_to_patches_the_scale_subresource_and_annotates_the_reason(fake, provider):
    provider.scale_to(3, "waiting 7 > 2 x 1 replica")
    (method, path, _, headers, body), annotate = fake.requests
    assert (method, path) == ("PATCH", DEPLOYMENT_PATH + "/scale")
    assert headers["Content-Type"] == "application/merge-patch+json"
    assert body == {"spec": {"replicas": 3}}
    assert annotate[:2] == ("PATCH", DEPLOYMENT_PATH)
    assert annotate[4] == {"metadata": {"annotations": {SCALE_REASON_ANNOTATION: "waiting 7 > 2 x 1 replica"}}}
    assert fake.deployment["spec"]["replicas"] == 3
    with pytest.raises(ValueError):
        provider.scale_to(-1, "never")


def test_a_refused_annotation_does_not_fail_the_scale_and_is_not_tried_again(fake, provider):
    fake.errors[("PATCH", DEPLOYMENT_PATH)] = (403, api_status(
        403, "Forbidden", 'deployments.apps "strata-engine" is forbidden: User cannot patch resource'))
    provider.scale_to(2, "kv usage 0.93 > 0.8")
    provider.scale_to(3, "kv usage 0.95 > 0.8")
    assert [(m, p) for m, p, *_ in fake.requests] == [
        ("PATCH", DEPLOYMENT_PATH + "/scale"), ("PATCH", DEPLOYMENT_PATH), ("PATCH", DEPLOYMENT_PATH + "/scale")]
    assert fake.deployment["spec"]["replicas"] == 3


def test_api_errors_carry_the_status_and_message(fake, provider):
    fake.deployment = None
    with pytest.raises(KubernetesApiError) as raised:
        provider.state()
    assert (raised.value.status, raised.value.reason) == (404, "NotFound")
    assert 'deployments.apps "strata-engine" not found' in str(raised.value)
    fake.deployment = deployment(1, 1)
    fake.errors[("PATCH", DEPLOYMENT_PATH + "/scale")] = (403, api_status(
        403, "Forbidden", "cannot patch resource deployments/scale"))
    with pytest.raises(KubernetesApiError, match="403 Forbidden: cannot patch resource deployments/scale"):
        provider.scale_to(2, "waiting")


def test_an_unreachable_api_server_is_an_api_error(fake):
    port = fake.port
    fake.close()
    provider = KubernetesProvider("strata-engine", "strata",
                                  KubernetesApi(f"http://127.0.0.1:{port}", token="t", timeout_s=2.0))
    with pytest.raises(KubernetesApiError) as raised:
        provider.state()
    assert raised.value.status == 0 and raised.value.reason == "Unreachable"


def test_label_selector_from_match_labels_and_expressions():
    assert label_selector({"matchLabels": {"b": "2", "a": "1"}}) == "a=1,b=2"
    expressions = [{"key": "tier", "operator": "In", "values": ["gpu", "cpu"]},
                   {"key": "canary", "operator": "DoesNotExist"}, {"key": "zone", "operator": "Exists"},
                   {"key": "pool", "operator": "NotIn", "values": ["spot"]}]
    assert label_selector({"matchExpressions": expressions}) == \
        "tier in (gpu,cpu),!canary,zone,pool notin (spot)"
    with pytest.raises(ValueError, match="empty"):
        label_selector({})


def test_in_cluster_uses_the_service_account_token_ca_and_namespace(tmp_path, monkeypatch):
    """As `strata autoscaler --provider kubernetes` makes it in a pod: the API server's address from
    the environment, the namespace, token and CA from the service-account mount, TLS verified
    against that CA; the token file is read per request (the kubelet rotates it)."""
    openssl = shutil.which("openssl")
    if openssl is None:
        pytest.skip("needs the openssl command to make a certificate for the stand-in API server")
    cert, key = tmp_path / "ca.crt", tmp_path / "key.pem"
    subprocess.run([openssl, "req", "-x509", "-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1",
                    "-nodes", "-days", "1", "-subj", "/CN=127.0.0.1", "-addext", "subjectAltName=IP:127.0.0.1",
                    "-keyout", str(key), "-out", str(cert)], check=True, capture_output=True)
    tls = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    tls.load_cert_chain(cert, key)
    fake = FakeApiServer(tls)
    try:
        (tmp_path / "token").write_text("first-token\n")
        (tmp_path / "namespace").write_text("strata\n")
        monkeypatch.setattr(kubernetes_provider, "SERVICE_ACCOUNT_DIR", tmp_path)
        monkeypatch.setenv("KUBERNETES_SERVICE_HOST", "127.0.0.1")
        monkeypatch.setenv("KUBERNETES_SERVICE_PORT", str(fake.port))
        provider = KubernetesProvider(deployment="strata-engine", namespace=None)
        assert provider.namespace == "strata" and provider.api.base_url == f"https://127.0.0.1:{fake.port}"
        assert provider.state().current == 1
        (tmp_path / "token").write_text("rotated-token\n")
        provider.scale_to(2, "test")
        tokens = [request[3]["Authorization"] for request in fake.requests]
        assert tokens[0] == "Bearer first-token" and tokens[-1] == "Bearer rotated-token"
    finally:
        fake.close()
    with pytest.raises(KubernetesApiError, match="KUBERNETES_SERVICE_HOST"):
        KubernetesApi.in_cluster(tmp_path, {})
    assert KubernetesApi.in_cluster(tmp_path, {"KUBERNETES_SERVICE_HOST": "fd00::1",
                                               "KUBERNETES_SERVICE_PORT": "443"}).base_url == "https://[fd00::1]:443"
