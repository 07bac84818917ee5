"""TLS (and mutual TLS) on every gRPC hop: the same three flags on every service.

    --tls-cert PEM  --tls-key PEM   this service's certificate and key: it serves TLS, and presents
                                    them as its client certificate when it calls another service
    --tls-ca PEM                    the CA that signed the others: a client verifies servers
                                    against it, and a server given it requires client certificates
                                    signed by it (mTLS)

No flags: plaintext, as before (loopback, or a mesh that encrypts for you). A service that only
calls others (the gateway) may give just --tls-ca. A certificate's names must cover the address it
is dialled at (an IP SAN for 127.0.0.1, a DNS SAN for a Kubernetes Service name).
"""

import argparse
from dataclasses import dataclass
from pathlib import Path

import grpc


@dataclass(frozen=True)
class TlsFiles:
    cert: Path | None = None
    key: Path | None = None
    ca: Path | None = None

    def __post_init__(self) -> None:
        if (self.cert is None) != (self.key is None):
            raise ValueError("--tls-cert and --tls-key go together")
        for path in (self.cert, self.key, self.ca):
            if path is not None and not Path(path).is_file():
                raise ValueError(f"TLS file {path} does not exist")

    @property
    def enabled(self) -> bool:
        return self.ca is not None or self.cert is not None

    def flags(self) -> list[str]:
        """The command-line flags that give these files to another service."""
        return [word for name, path in (("--tls-cert", self.cert), ("--tls-key", self.key), ("--tls-ca", self.ca))
                if path is not None for word in (name, str(path))]

    def server_credentials(self) -> grpc.ServerCredentials:
        if self.cert is None:
            raise ValueError("serving TLS needs --tls-cert and --tls-key")
        ca = Path(self.ca).read_bytes() if self.ca else None
        return grpc.ssl_server_credentials([(Path(self.key).read_bytes(), Path(self.cert).read_bytes())],
                                           root_certificates=ca, require_client_auth=ca is not None)

    def channel_credentials(self) -> grpc.ChannelCredentials:
        return grpc.ssl_channel_credentials(
            root_certificates=Path(self.ca).read_bytes() if self.ca else None,
            private_key=Path(self.key).read_bytes() if self.key else None,
            certificate_chain=Path(self.cert).read_bytes() if self.cert else None)


def add_tls_args(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group("TLS on gRPC (services.common.tls)")
    group.add_argument("--tls-cert", type=Path, help="this service's certificate (PEM): serve TLS, and present it "
                       "to the services it calls")
    group.add_argument("--tls-key", type=Path, help="the certificate's private key (PEM)")
    group.add_argument("--tls-ca", type=Path, help="CA certificate (PEM) to verify the services called; a server "
                       "given it requires client certificates signed by it (mTLS)")


def tls_from_args(args: argparse.Namespace, parser: argparse.ArgumentParser | None = None) -> TlsFiles | None:
    """The TLS files the flags name, or None for plaintext; a bad combination is a usage error."""
    try:
        files = TlsFiles(args.tls_cert, args.tls_key, args.tls_ca)
    except ValueError as error:
        if parser is None:
            raise
        parser.error(str(error))
    return files if files.enabled else None


def aio_channel(address: str, tls: TlsFiles | None, options=(), interceptors=None) -> grpc.aio.Channel:
    if tls is None:
        return grpc.aio.insecure_channel(address, options=list(options), interceptors=interceptors)
    return grpc.aio.secure_channel(address, tls.channel_credentials(), options=list(options),
                                   interceptors=interceptors)


def sync_channel(address: str, tls: TlsFiles | None, options=()) -> grpc.Channel:
    if tls is None:
        return grpc.insecure_channel(address, options=list(options))
    return grpc.secure_channel(address, tls.channel_credentials(), options=list(options))
