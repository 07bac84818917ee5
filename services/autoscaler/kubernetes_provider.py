"""``KubernetesProvider``: the engine Deployment's replica count through the Kubernetes API.

It reads the Deployment (``spec.replicas``, ``status.readyReplicas``) and its pods, and scales by a
merge patch of the Deployment's ``scale`` subresource, so the autoscaler's role needs no more than
get/patch on ``deployments/scale``, get/list on ``deployments`` and ``pods`` (and patch on that one
Deployment for the reason annotation, which is skipped when refused). A scale-down drains: the
ReplicaSet deletes a pod, the kubelet runs its preStop hook and sends SIGTERM, and the engine turns
NOT_SERVING at once and exits once its running requests finish (``--shutdown-timeout``, inside the
pod's ``terminationGracePeriodSeconds``).

The API is spoken with the standard library (urllib, ssl, json): in a pod, ``KubernetesApi.in_cluster()``
takes the API server from ``KUBERNETES_SERVICE_HOST``/``_PORT`` and the service account's token, CA
and namespace from ``/var/run/secrets/kubernetes.io/serviceaccount``; the token file is read again
for every request, since the kubelet rotates it.
"""

import json
import logging
import os
import ssl
import time
import urllib.error
import urllib.parse
import urllib.request
from collections.abc import Callable, Mapping
from datetime import datetime
from pathlib import Path

from services.autoscaler.provider import FleetState

log = logging.getLogger(__name__)

SERVICE_ACCOUNT_DIR = Path("/var/run/secrets/kubernetes.io/serviceaccount")
SCALE_REASON_ANNOTATION = "strata.ai/last-scale-reason"
_MERGE_PATCH = "application/merge-patch+json"
_SELECTOR_OPERATORS = {"In": "in", "NotIn": "notin"}


class KubernetesApiError(RuntimeError):
    """A request the API server refused or could not be sent; ``status`` is the HTTP status (0 when
    no answer came), ``reason`` and ``message`` are the API's ``Status`` fields when it sent one."""

    def __init__(self, method: str, path: str, status: int, reason: str, message: str) -> None:
        self.method, self.path, self.status, self.reason, self.message = method, path, status, reason, message
        super().__init__(f"Kubernetes API {method} {path}: {status} {reason}: {message}")


class KubernetesApi:
    """A minimal JSON client of one API server: ``request(method, path, body)`` returns the decoded
    answer or raises ``KubernetesApiError``."""

    def __init__(self, base_url: str, *, token: str | None = None, token_path: Path | None = None,
                 ca_path: Path | None = None, timeout_s: float = 10.0) -> None:
        self.base_url = base_url.rstrip("/")
        self.token = token
        self.token_path = token_path
        self.timeout_s = timeout_s
        self.ssl_context = ssl.create_default_context(cafile=str(ca_path)) if ca_path else None

    @classmethod
    def in_cluster(cls, service_account_dir: Path | None = None, environ: Mapping[str, str] | None = None,
                   timeout_s: float = 10.0) -> "KubernetesApi":
        """The API server of the cluster this pod runs in, as its service account."""
        service_account_dir = service_account_dir or SERVICE_ACCOUNT_DIR
        environ = os.environ if environ is None else environ
        host, port = environ.get("KUBERNETES_SERVICE_HOST"), environ.get("KUBERNETES_SERVICE_PORT")
        if not host or not port:
            raise KubernetesApiError("GET", "/", 0, "NotInCluster", "KUBERNETES_SERVICE_HOST/PORT are not set: "
                                     "run in a pod, or give the API server's URL and a token")
        if ":" in host:
            host = f"[{host}]"  # an IPv6 address
        return cls(f"https://{host}:{port}", token_path=service_account_dir / "token",
                   ca_path=service_account_dir / "ca.crt", timeout_s=timeout_s)

    def _bearer_token(self) -> str | None:
        if self.token_path is not None:
            return self.token_path.read_text().strip()
        return self.token

    def request(self, method: str, path: str, body: dict | None = None,
                content_type: str = "application/json") -> dict:
        headers = {"Accept": "application/json"}
        token = self._bearer_token()
        if token:
            headers["Authorization"] = f"Bearer {token}"
        data = None
        if body is not None:
            data = json.dumps(body).encode()
            headers["Content-Type"] = content_type
        request = urllib.request.Request(self.base_url + path, data=data, headers=headers, method=method)
        try:
            with urllib.request.urlopen(request, timeout=self.timeout_s, context=self.ssl_context) as response:
                return json.loads(response.read() or b"{}")
        except urllib.error.HTTPError as error:
            status = _status_object(error)
            raise KubernetesApiError(method, path, error.code, status.get("reason") or error.reason,
                                     status.get("message") or "") from None
        except (urllib.error.URLError, OSError) as error:
            reason = getattr(error, "reason", error)
            raise KubernetesApiError(method, path, 0, "Unreachable", str(reason)) from error


def in_cluster_namespace(service_account_dir: Path | None = None) -> str:
    """The namespace this pod runs in, as its service account's mount says."""
    return ((service_account_dir or SERVICE_ACCOUNT_DIR) / "namespace").read_text().strip()


class KubernetesProvider:
    """The replicas of one Deployment (the engines) in one namespace.

    ``state()`` counts ``spec.replicas`` as current and ``status.readyReplicas`` as ready (ready is
    the engine's readiness probe: its gRPC health says SERVING). The starting time is that of the
    oldest of the Deployment's pods that is not Ready, leaving out pods being deleted (they drain)
    and pods that ended (an evicted pod stays listed as Failed). ``scale_to()`` returns as soon as
    the API accepted the new count.
    """

    name = "kubernetes"

    def __init__(self, deployment: str, namespace: str | None = None, api: KubernetesApi | None = None, *,
                 reason_annotation: str | None = SCALE_REASON_ANNOTATION,
                 clock: Callable[[], float] = time.time) -> None:
        """``namespace`` and ``api`` default to the pod's own: its namespace and its service account."""
        self.deployment = deployment
        self.namespace = namespace or in_cluster_namespace()
        self.api = api or KubernetesApi.in_cluster()
        self.reason_annotation = reason_annotation
        self.clock = clock
        namespace_path = urllib.parse.quote(self.namespace, safe="")
        self._deployment_path = (f"/apis/apps/v1/namespaces/{namespace_path}/deployments/"
                                 f"{urllib.parse.quote(deployment, safe='')}")
        self._pods_path = f"/api/v1/namespaces/{namespace_path}/pods"

    def state(self) -> FleetState:
        deployment = self.api.request("GET", self._deployment_path)
        spec, status = deployment.get("spec", {}), deployment.get("status", {})
        selector = label_selector(spec.get("selector", {}))
        query = urllib.parse.urlencode({"labelSelector": selector})
        pods = self.api.request("GET", f"{self._pods_path}?{query}").get("items", [])
        starting = [_created_at(pod) for pod in pods if _is_starting(pod)]
        return FleetState(current=int(spec.get("replicas", 1)), ready=int(status.get("readyReplicas") or 0),
                          oldest_starting_s=max(0.0, self.clock() - min(starting)) if starting else None)

    def scale_to(self, count: int, reason: str) -> None:
        if count < 0:
            raise ValueError(f"cannot scale {self.deployment} to {count} replicas")
        self.api.request("PATCH", f"{self._deployment_path}/scale", {"spec": {"replicas": count}}, _MERGE_PATCH)
        log.info("scaled deployment %s/%s to %d: %s", self.namespace, self.deployment, count, reason)
        if self.reason_annotation:
            self._annotate(reason)

    def _annotate(self, reason: str) -> None:
        """Records the reason on the Deployment (``kubectl describe`` shows it); a refusal turns it off."""
        patch = {"metadata": {"annotations": {self.reason_annotation: reason}}}
        try:
            self.api.request("PATCH", self._deployment_path, patch, _MERGE_PATCH)
        except KubernetesApiError as error:
            if error.status in (401, 403):
                log.warning("not annotating %s with the scale reason any more: %s", self.deployment, error)
                self.reason_annotation = None
            else:
                log.warning("could not annotate %s with the scale reason: %s", self.deployment, error)

    def close(self) -> None:
        """Nothing to release: the Deployment and its pods outlive the autoscaler."""


def label_selector(selector: dict) -> str:
    """A ``LabelSelector`` object as the ``labelSelector`` query string the API takes."""
    terms = [f"{key}={value}" for key, value in sorted(selector.get("matchLabels", {}).items())]
    for expression in selector.get("matchExpressions", []):
        key, operator, values = expression["key"], expression["operator"], expression.get("values", [])
        if operator in _SELECTOR_OPERATORS:
            terms.append(f"{key} {_SELECTOR_OPERATORS[operator]} ({','.join(values)})")
        elif operator == "Exists":
            terms.append(key)
        elif operator == "DoesNotExist":
            terms.append(f"!{key}")
        else:
            raise ValueError(f"unknown label selector operator {operator!r}")
    if not terms:
        raise ValueError("the deployment's selector is empty: it would select every pod in the namespace")
    return ",".join(terms)


def _is_starting(pod: dict) -> bool:
    metadata, status = pod.get("metadata", {}), pod.get("status", {})
    if metadata.get("deletionTimestamp") or status.get("phase") in ("Succeeded", "Failed"):
        return False
    ready = next((c for c in status.get("conditions", []) if c.get("type") == "Ready"), None)
    return ready is None or ready.get("status") != "True"


def _created_at(pod: dict) -> float:
    return datetime.fromisoformat(pod["metadata"]["creationTimestamp"]).timestamp()


def _status_object(error: urllib.error.HTTPError) -> dict:
    """The API's ``Status`` answer in an error response, or {} when its body is not one (a proxy's page)."""
    try:
        with error:
            status = json.loads(error.read())
    except (ValueError, OSError, AttributeError):
        return {}
    return status if isinstance(status, dict) else {}
