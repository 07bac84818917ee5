"""Which replica serves a request: the one where it costs least, counting in KV blocks.

``cost = blocks to prefill there + blocks of work the replica already has``. The first term is the
prompt's full blocks minus the ones its prefix cache holds (the prefix index); the second is the
larger of the KV blocks its last load report showed in use and the prompt blocks of the requests
this router has in flight on it (instant, where reports lag). So a cached prefix pulls a request to
its replica until that replica is busier than the prefill the cache would save; with no overlap
anywhere, requests spread by load. Ties go to fewer requests in flight, then round-robin.
"""

from collections.abc import Sequence
from dataclasses import dataclass


@dataclass
class Candidate:
    """One healthy replica as the policy sees it."""

    name: str
    matched_blocks: int  # the prompt's leading blocks in its prefix cache
    kv_blocks_used: int  # from its last load report
    in_flight_blocks: int  # prompt blocks of this router's requests running there
    in_flight: int  # this router's requests running there


def cost(candidate: Candidate, prompt_blocks: int) -> int:
    return (prompt_blocks - candidate.matched_blocks) + max(candidate.kv_blocks_used, candidate.in_flight_blocks)


def choose(candidates: Sequence[Candidate], prompt_blocks: int, turn: int) -> Candidate:
    """The cheapest candidate; ``turn`` (a counter) rotates among equals."""
    best = min((cost(c, prompt_blocks), c.in_flight) for c in candidates)
    tied = [c for c in candidates if (cost(c, prompt_blocks), c.in_flight) == best]
    return tied[turn % len(tied)]
