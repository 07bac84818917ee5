"""How the autoscaler acts: a ``ReplicaProvider`` runs engine replicas and changes their number.

The decision code (`decision.py`) never knows whether replicas are local processes or pods; it sees
a ``FleetState`` and returns a count, and the provider makes it so:

- ``LocalProcessProvider`` (`local_provider.py`): engine processes on this machine, used by
  `strata up --autoscale`; each new engine gets its own cores and announces itself on NATS.
- ``KubernetesProvider`` (`kubernetes_provider.py`): the engine Deployment's ``scale``
  subresource through the Kubernetes API.

Scale-down drains: the provider never kills a replica that is serving; it asks it to stop (SIGTERM
locally, a pod deletion on a cluster), the engine stops taking requests at once (health NOT_SERVING,
which the router follows) and exits once its running requests finish, or its drain timeout passes.
"""

from dataclasses import dataclass
from typing import Protocol


@dataclass(frozen=True)
class FleetState:
    """The replicas a provider runs at one moment."""

    current: int  # replicas asked for: ready + starting (not those draining away)
    ready: int  # of those, how many report SERVING
    oldest_starting_s: float | None = None  # seconds the longest-starting replica has been starting; None: none


class ReplicaProvider(Protocol):
    name: str  # "local" or "kubernetes", in logs and metrics

    def state(self) -> FleetState:
        """Where the fleet is now (may block briefly: a process poll, an API call)."""

    def scale_to(self, count: int, reason: str) -> None:
        """Starts or drains replicas until ``count`` are asked for; returns without waiting for them."""

    def close(self) -> None:
        """Releases what the provider holds (a local provider stops its replicas, draining them)."""
