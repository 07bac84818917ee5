"""Where the KV cache reports what it holds: blocks stored, blocks removed, everything cleared.

The engine is the only owner of KV state; the router keeps an index of each replica's blocks built
from these events. A sink receives them synchronously from the block pool while the scheduler runs,
so an implementation must be cheap (the NATS publisher buffers and sends one batch per step).
"""

from dataclasses import dataclass
from typing import Protocol


class KvEventSink(Protocol):
    """Receives every change to the set of cached (hashed) blocks, in the order it happens."""

    def blocks_stored(self, parent_hash: int | None, block_hashes: list[int]) -> None:
        """Full blocks became cached. ``block_hashes`` is a chain: the first block's parent is
        ``parent_hash`` (None when it is the first block of a sequence), each next block's parent
        is the one before it."""

    def blocks_removed(self, block_hashes: list[int]) -> None:
        """Cached blocks were evicted; their hashes no longer name anything on this replica."""

    def all_cleared(self) -> None:
        """The whole prefix cache was dropped."""


class NullKvEventSink:
    """Discards every event (no NATS, or a test that does not look)."""

    def blocks_stored(self, parent_hash: int | None, block_hashes: list[int]) -> None:
        pass

    def blocks_removed(self, block_hashes: list[int]) -> None:
        pass

    def all_cleared(self) -> None:
        pass


@dataclass(frozen=True)
class BlocksStored:
    parent_hash: int | None
    block_hashes: tuple[int, ...]


@dataclass(frozen=True)
class BlocksRemoved:
    block_hashes: tuple[int, ...]


@dataclass(frozen=True)
class AllCleared:
    pass


KvEvent = BlocksStored | BlocksRemoved | AllCleared


class RecordingKvEventSink:
    """Keeps every event in ``events``, in order."""

    def __init__(self) -> None:
        self.events: list[KvEvent] = []

    def blocks_stored(self, parent_hash: int | None, block_hashes: list[int]) -> None:
        self.events.append(BlocksStored(parent_hash, tuple(block_hashes)))

    def blocks_removed(self, block_hashes: list[int]) -> None:
        self.events.append(BlocksRemoved(tuple(block_hashes)))

    def all_cleared(self) -> None:
        self.events.append(AllCleared())

    def take(self) -> list[KvEvent]:
        """The events recorded so far; the record starts empty again."""
        events, self.events = self.events, []
        return events
