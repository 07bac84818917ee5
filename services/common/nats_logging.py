"""What a NATS connection says in the log: one warning when it is lost, one line when it is back.

nats-py's default error callback logs every failed reconnect attempt as ERROR with a traceback
(``nats: encountered error``): twice a second while NATS is away, and at every normal shutdown of a
stack whose NATS stops first. A lost connection is not an error here (the events are best-effort,
the router falls back to polling, and the client reconnects by itself), so these callbacks log it
once, as a warning without a traceback, until it is back.

    connection = await nats.connect(url, **connection_callbacks("strata-router"), **connect_options())
"""

import logging

log = logging.getLogger("services.nats")


def connection_callbacks(name: str) -> dict:
    """``nats.connect`` keyword arguments: ``error_cb`` and ``reconnected_cb`` (not ``disconnected_cb``,
    which a normal ``close()`` calls too)."""
    state = {"lost": False}

    async def on_error(error: Exception) -> None:
        if not state["lost"]:
            state["lost"] = True
            log.warning("%s: NATS connection error: %s: %s (reconnecting)", name, type(error).__name__,
                        error or "-")

    async def on_reconnected() -> None:
        state["lost"] = False
        log.info("%s: NATS connection back", name)

    return {"error_cb": on_error, "reconnected_cb": on_reconnected}
