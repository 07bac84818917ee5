"""NATS credentials: every Strata connection to NATS (engines publishing, the router and the
autoscaler subscribing) authenticates with one shared token, read from the environment, never from
the command line (where `ps` would show it):

- ``STRATA_NATS_TOKEN``: the token itself, or
- ``STRATA_NATS_TOKEN_FILE``: a file holding it (a Kubernetes Secret or a Docker secret mounted as a file).

Credentials in the URL (``nats://user:password@host:4222``) work too. A NATS server started with the
same token (``authorization { token: ... }``) refuses clients without it, so a forged load report
cannot reach the router; the router only lets replicas *join* through NATS when its own connection is
authenticated (`services/router`).
"""

import os
from pathlib import Path
from urllib.parse import urlsplit

TOKEN_VARIABLE = "STRATA_NATS_TOKEN"
TOKEN_FILE_VARIABLE = "STRATA_NATS_TOKEN_FILE"


def nats_token(environ=os.environ) -> str | None:
    if environ.get(TOKEN_VARIABLE):
        return environ[TOKEN_VARIABLE]
    path = environ.get(TOKEN_FILE_VARIABLE)
    if path:
        token = Path(path).read_text().strip()
        if not token:
            raise ValueError(f"{TOKEN_FILE_VARIABLE}={path} is empty")
        return token
    return None


def connect_options(environ=os.environ) -> dict:
    """Keyword arguments for ``nats.connect`` carrying the token, when one is configured."""
    token = nats_token(environ)
    return {"token": token} if token else {}


def is_authenticated(url: str, environ=os.environ) -> bool:
    """Whether a connection to ``url`` presents credentials (a token, or user info in the URL)."""
    return bool(nats_token(environ)) or bool(urlsplit(url).username)


def server_config(token: str) -> str:
    """A nats-server configuration that requires ``token`` (written to a file: never on its argv)."""
    quoted = token.replace("\\", "\\\\").replace('"', '\\"')
    return f'authorization {{\n  token: "{quoted}"\n}}\n'
