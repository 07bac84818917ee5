"""The router looks prompts up under the same block hashes the engine names its cached blocks by: one
salted hash function (`services.common.block_hash`), the salt rule in it alone, and the block size of
each replica from its Info (no default of the router's own)."""

import pytest

from services.common.pb import engine_pb2, events_pb2
from services.engine.kv_cache_manager import KVCacheManager
from services.engine.request import Request
from services.engine.sampling_params import SamplingParams
from services.router.placement import Placement
from services.router.prefix_index import PrefixIndex
from services.router.replicas import Replica, ReplicaSet

PROMPT = list(range(100, 150))  # three full blocks of 16, and two tokens more


def engine_hashes(block_size: int, seed: int, salt: str) -> list[int]:
    manager = KVCacheManager(num_blocks=16, block_size=block_size, hash_seed=seed)
    request = Request("r", PROMPT, SamplingParams(), cache_salt=salt)
    manager.get_computed_blocks(request)  # names the request's full blocks
    return request.block_hashes


def router(seed: int) -> Placement:
    return Placement(ReplicaSet([]), PrefixIndex(), seed)


@pytest.mark.parametrize("salt", ["", "tenant-a"])
@pytest.mark.parametrize("block_size, seed", [(16, 0), (8, 1234)])
def test_router_and_engine_hash_a_prompt_alike(block_size, seed, salt):
    request = engine_pb2.GenerateRequest(prompt_token_ids=PROMPT, cache_salt=salt)
    hashes = router(seed).prompt_hashes(request, block_size)
    assert hashes == engine_hashes(block_size, seed, salt)
    assert len(hashes) == len(PROMPT) // block_size


def test_a_salt_changes_every_block_hash():
    salted, plain = engine_hashes(16, 0, "tenant-a"), engine_hashes(16, 0, "")
    assert not set(salted) & set(plain)


def test_each_replica_is_matched_at_its_own_block_size():
    placement = router(0)
    request = engine_pb2.GenerateRequest(prompt_token_ids=PROMPT)
    for address, block_size in (("a:1", 16), ("b:1", 8)):
        replica = Replica(address, channel=None, stub=None, health=None)  # placement never calls it
        replica.healthy, replica.replica_id = True, address
        replica.info = engine_pb2.EngineInfoResponse(block_size=block_size)
        placement.replicas.replicas[address] = replica
    # b:1 (blocks of 8) holds the prompt's first 4 of its 6 blocks; a:1 (blocks of 16) none of its 3.
    placement.index.apply(events_pb2.KvEventBatch(replica_id="b:1", seq=1, block_size=8, events=[events_pb2.KvEvent(
        stored=events_pb2.KvBlocksStored(block_hashes=placement.prompt_hashes(request, 8)[:4]))]))
    replica, overlap = placement.pick(request, exclude=set())
    assert replica.address == "b:1" and overlap == pytest.approx(4 / 6)
