"""What each replica holds in its prefix cache, rebuilt from its KV events on NATS.

A replica's blocks are a set of chained block hashes (``services.common.block_hash``), so a prompt's
overlap with a replica is how many of the prompt's leading block hashes the set holds. Events come
in numbered batches: the first batch seen from a replica is taken whatever its number (the router
may start after the engine: what it missed only makes it underestimate); a later gap, or a number
that goes back (the engine restarted), means removals may have been lost, so that replica's set is
emptied rather than trusted, and fills again from the next stores.
"""

import logging
from collections.abc import Sequence

from services.common.pb import events_pb2

log = logging.getLogger(__name__)


class PrefixIndex:
    def __init__(self) -> None:
        self._blocks: dict[str, set[int]] = {}
        self._last_seq: dict[str, int] = {}

    def apply(self, batch: events_pb2.KvEventBatch) -> None:
        replica = batch.replica_id
        blocks = self._blocks.setdefault(replica, set())
        last = self._last_seq.get(replica)
        if last is not None and batch.seq != last + 1:
            log.warning("KV events of %s jumped from seq %d to %d: forgetting its index until new stores",
                        replica, last, batch.seq)
            blocks.clear()
        self._last_seq[replica] = batch.seq
        for event in batch.events:
            kind = event.WhichOneof("event")
            if kind == "stored":
                blocks.update(event.stored.block_hashes)
            elif kind == "removed":
                blocks.difference_update(event.removed.block_hashes)
            elif kind == "cleared":
                blocks.clear()

    def overlap(self, replica: str, block_hashes: Sequence[int]) -> int:
        """How many leading blocks of a prompt (its chained ``block_hashes``) the replica holds."""
        blocks = self._blocks.get(replica)
        if not blocks:
            return 0
        matched = 0
        for block_hash in block_hashes:
            if block_hash not in blocks:
                break
            matched += 1
        return matched

    def forget(self, replica: str) -> None:
        """The replica is gone (or restarted): nothing of what it held is known any more."""
        self._blocks.pop(replica, None)
        self._last_seq.pop(replica, None)

    def num_blocks(self, replica: str) -> int:
        return len(self._blocks.get(replica, ()))
