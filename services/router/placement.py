"""Where a request goes: the prompt's block hashes at each healthy replica's block size (from its
Info), how many leading blocks each replica holds (the prefix index), each one's load, and the
policy's choice among them (`policy.POLICIES`)."""

import itertools

from services.common.block_hash import hash_prompt_blocks
from services.common.pb import engine_pb2
from services.router.policy import POLICIES, Candidate
from services.router.prefix_index import PrefixIndex
from services.router.replicas import Replica, ReplicaSet


class Placement:
    def __init__(self, replicas: ReplicaSet, index: PrefixIndex, hash_seed: int, policy: str = "cache-aware") -> None:
        if policy not in POLICIES:
            raise ValueError(f"--policy {policy!r} is not one of {', '.join(POLICIES)}")
        self.replicas = replicas
        self.index = index
        self.hash_seed = hash_seed
        self.policy = POLICIES[policy]
        self._turns = itertools.count()

    def pick(self, request: engine_pb2.GenerateRequest, exclude: set[str]) -> tuple[Replica, float] | None:
        """The replica for ``request`` among the healthy ones not in ``exclude`` (addresses), with the
        fraction of the prompt's full blocks it holds; None when there is none."""
        healthy = [r for r in self.replicas.healthy() if r.address not in exclude]
        if not healthy:
            return None
        hashes_by_block_size: dict[int, list[int]] = {}
        candidates = []
        for replica in healthy:  # a healthy replica has answered Info (ReplicaSet.check)
            block_size = replica.info.block_size
            if block_size not in hashes_by_block_size:
                hashes_by_block_size[block_size] = self.prompt_hashes(request, block_size)
            hashes = hashes_by_block_size[block_size]
            candidates.append(Candidate(replica.address, self.index.overlap(replica.replica_id, hashes),
                                        replica.in_flight + replica.num_waiting, len(hashes)))
        chosen = self.policy(candidates, next(self._turns))
        return self.replicas.replicas[chosen.name], chosen.overlap

    def prompt_hashes(self, request: engine_pb2.GenerateRequest, block_size: int) -> list[int]:
        """The prompt's block hashes as an engine of ``block_size`` names its cached blocks."""
        return hash_prompt_blocks(request.prompt_token_ids, block_size, self.hash_seed, request.cache_salt)
