"""Which replica serves a request: the one holding most of its prefix, unless that would unbalance
the fleet (the approach of SGLang's cache-aware router).

A replica's load is the requests it has: this router's in flight there, plus the waiting ones its
last load report showed (other routers' traffic). While the fleet is balanced (the busiest replica
has at most ``max_imbalance`` more requests than the idlest, or at most ``max_ratio`` times as
many), a request goes to the replica whose prefix cache holds most of its leading blocks, so its
prefill is mostly skipped; among equals (no overlap anywhere, say), to the least loaded, then in
turn. Once the fleet is unbalanced, a request goes to the least loaded replica whatever the caches
hold, until the fleet evens out.
"""

from collections.abc import Callable, Sequence
from dataclasses import dataclass

MAX_IMBALANCE = 8  # requests
MAX_RATIO = 1.5


@dataclass
class Candidate:
    """One healthy replica as the policy sees it."""

    name: str
    matched_blocks: int  # the prompt's leading blocks in its prefix cache
    load: int  # requests it has: this router's in flight there + its reported waiting
    num_blocks: int = 0  # the prompt's full blocks at this replica's block size

    @property
    def overlap(self) -> float:
        """The fraction of the prompt's full blocks it holds."""
        return self.matched_blocks / self.num_blocks if self.num_blocks else 0.0


def is_balanced(candidates: Sequence[Candidate], max_imbalance: int = MAX_IMBALANCE,
                max_ratio: float = MAX_RATIO) -> bool:
    busiest, idlest = max(c.load for c in candidates), min(c.load for c in candidates)
    return busiest - idlest <= max_imbalance or busiest <= max_ratio * idlest


def choose(candidates: Sequence[Candidate], turn: int, max_imbalance: int = MAX_IMBALANCE,
           max_ratio: float = MAX_RATIO) -> Candidate:
    """The replica for a request; ``turn`` (a counter) rotates among equals."""
    if is_balanced(candidates, max_imbalance, max_ratio):
        key = lambda c: (-c.matched_blocks, c.load)  # noqa: E731
    else:
        key = lambda c: (c.load, -c.matched_blocks)  # noqa: E731
    best = min(key(c) for c in candidates)
    tied = [c for c in candidates if key(c) == best]
    return tied[turn % len(tied)]


def round_robin(candidates: Sequence[Candidate], turn: int) -> Candidate:
    """The baseline: each in turn, blind to caches and load."""
    return candidates[turn % len(candidates)]


# --policy NAME -> policy(candidates, turn) -> the chosen candidate
POLICIES: dict[str, Callable[[Sequence[Candidate], int], Candidate]] = {"cache-aware": choose,
                                                                        "round-robin": round_robin}
