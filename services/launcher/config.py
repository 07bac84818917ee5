"""`StackConfig`: what `strata up` (and `Stack`) starts, and with which flags."""

from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # services.common.tls imports grpc, which must not load before the children fork
    from services.common.tls import TlsFiles


@dataclass
class StackConfig:
    model: str | None = None  # None: the built-in default model
    host: str = "127.0.0.1"
    port: int = 8000
    served_model_name: str | None = None
    served_model_aliases: list[str] = field(default_factory=list)  # more names the gateway accepts
    api_key: str | None = None
    engine_args: list[str] = field(default_factory=list)
    gateway_args: list[str] = field(default_factory=list)
    log_dir: Path | None = None
    echo_logs: bool = True
    # A large checkpoint loads for minutes and its graphs compile for minutes more on a first start (a
    # 32-layer model's nine graphs took 175 s on 2 cores); a service that fails exits and is named at once.
    startup_timeout_s: float = 900.0
    grace_s: float = 70.0  # to stop: running streams finish first (engines drain up to their --shutdown-timeout)
    cache_dir: Path | None = None  # where the default model is built (None: its own default)
    replicas: int = 1  # engine replicas; more than one puts a router (and NATS, when installed) in front
    router_args: list[str] = field(default_factory=list)
    tokenizer_args: list[str] = field(default_factory=list)
    autoscale: bool = False  # the autoscaler runs the engines (min..max replicas) instead of `replicas`
    min_replicas: int = 1
    max_replicas: int = 3
    autoscaler_args: list[str] = field(default_factory=list)
    tls: "TlsFiles | None" = None  # --tls-cert/--tls-key/--tls-ca for every gRPC service (services.common.tls)
    restart_backoff_s: float = 1.0  # a service that dies is started again after this, doubling while it keeps dying
    log_level: str | None = None  # --log-level for every service (None: each one's default)
    log_format: str | None = None  # --log-format (text, json) for every service

    def log_flags(self) -> list[str]:
        """The stack-wide logging flags, given to each service before its own flags (which win)."""
        return [*(["--log-level", self.log_level] if self.log_level else []),
                *(["--log-format", self.log_format] if self.log_format else [])]
