"""Strata's services. Importing this package sets what every service process needs before gRPC loads.

gRPC's I/O path: since 1.6x, gRPC's core runs its client and listener I/O on the EventEngine, which hands
each message across threads of its own before grpc.aio's poller thread passes it to the event loop. At
one stream a message per token crosses every hop, and those hand-offs (a sleep and a wake-up each) were
most of what the gateway and the tokenizer spent per token. gRPC's older I/O path
(``GRPC_EXPERIMENTS=-event_engine_client,-event_engine_listener``, grpcio 1.85) takes fewer. Measured on
the 2-core Xeon through ``strata up`` (bfloat16, one stream, three A/Bs): per token, the gateway's
context switches 17.3-18.2 -> 7.1-7.2 and CPU 0.58-0.69 -> 0.43-0.49 ms, the tokenizer's 12.5-12.7 ->
5.5-5.6 and 0.28-0.36 -> 0.22-0.25 ms; a grpc.aio bidi round trip on loopback 298-323 -> 136-219 us.
At 64 streams, where a message carries a step's outputs for every request, no difference.

On that path a synchronous channel whose connection failed notices a server that has come up only when
gRPC's backup poller next runs, every 5 s by default (an asyncio channel polls all the time): a channel
polling an engine's health while it loaded saw it first 3.9 s after it listened, against 0.06 s on the
EventEngine. ``GRPC_CLIENT_CHANNEL_BACKUP_POLL_INTERVAL_MS=100`` brings that to 0.11 s.

gRPC reads these variables once, when it loads, so they are set here, before any service module imports
grpc (a process that imported grpc first keeps gRPC's defaults); a value of the user's own is left as it
is. Child processes (the launcher's services, the tests' servers) inherit them.
"""

import os

GRPC_EXPERIMENTS = "-event_engine_client,-event_engine_listener"
GRPC_BACKUP_POLL_INTERVAL_MS = "100"

os.environ.setdefault("GRPC_EXPERIMENTS", GRPC_EXPERIMENTS)
os.environ.setdefault("GRPC_CLIENT_CHANNEL_BACKUP_POLL_INTERVAL_MS", GRPC_BACKUP_POLL_INTERVAL_MS)
