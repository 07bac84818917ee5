"""Certificates for the TLS tests, made with the openssl command line: a CA, and one certificate
(serverAuth and clientAuth, names 127.0.0.1 and localhost) that every service uses, plus a
certificate from another CA that must be refused."""

import subprocess
from pathlib import Path

from services.common.tls import TlsFiles


def _openssl(*args: str, cwd: Path) -> None:
    subprocess.run(["openssl", *args], cwd=cwd, check=True, capture_output=True)


def make_ca(directory: Path, name: str) -> tuple[Path, Path]:
    _openssl("req", "-x509", "-newkey", "rsa:2048", "-nodes", "-days", "2", "-subj", f"/CN={name}",
             "-keyout", f"{name}.key", "-out", f"{name}.pem", cwd=directory)
    return directory / f"{name}.pem", directory / f"{name}.key"


def make_leaf(directory: Path, ca: tuple[Path, Path], name: str) -> tuple[Path, Path]:
    (directory / f"{name}.ext").write_text("subjectAltName=IP:127.0.0.1,DNS:localhost\n"
                                           "extendedKeyUsage=serverAuth,clientAuth\n")
    _openssl("req", "-newkey", "rsa:2048", "-nodes", "-subj", f"/CN={name}", "-keyout", f"{name}.key",
             "-out", f"{name}.csr", cwd=directory)
    _openssl("x509", "-req", "-in", f"{name}.csr", "-CA", str(ca[0]), "-CAkey", str(ca[1]), "-CAcreateserial",
             "-days", "2", "-extfile", f"{name}.ext", "-out", f"{name}.pem", cwd=directory)
    return directory / f"{name}.pem", directory / f"{name}.key"


def make_tls(directory: Path) -> tuple[TlsFiles, TlsFiles]:
    """(the stack's files: its CA and a certificate it signed; a stranger's: another CA's)."""
    directory.mkdir(parents=True, exist_ok=True)
    ca = make_ca(directory, "strata-ca")
    cert, key = make_leaf(directory, ca, "service")
    other_ca = make_ca(directory, "other-ca")
    other_cert, other_key = make_leaf(directory, other_ca, "stranger")
    return TlsFiles(cert, key, ca[0]), TlsFiles(other_cert, other_key, ca[0])
