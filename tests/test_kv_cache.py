"""Block pool bookkeeping, without a model; and the int8 KV cache against full precision."""

import torch

from backends.builtin.core.kv_cache import KVCacheManager
from backends.builtin.core.sequence import SamplingParams, Sequence

from .test_kernels import filled_cache


def seq(tokens: list[int], cache_salt: str | None = None) -> Sequence:
    return Sequence(list(tokens), SamplingParams(temperature=0.0), cache_salt=cache_salt)


def computed(kv: KVCacheManager, tokens, cache_salt: str | None = None) -> Sequence:
    """A sequence admitted, fully computed and offered to the prefix cache."""
    s = seq(tokens, cache_salt)
    assert kv.allocate(s, len(s), kv.match_prefix(s))
    s.num_computed_tokens = len(s)
    kv.cache_full_blocks(s, s.num_computed_tokens)
    return s


def test_200_tokens_hold_13_blocks_and_free_returns_all():
    kv = KVCacheManager(num_blocks=64, block_size=16)
    s = seq(range(200))
    assert kv.allocate(s, 200, kv.match_prefix(s))
    assert len(s.block_table) == 13 and kv.num_used == 13
    kv.free(s)
    assert kv.num_free == 64 and all(b.ref_count == 0 for b in kv.blocks)


def test_allocation_is_all_or_nothing():
    kv = KVCacheManager(num_blocks=4, block_size=16)
    s = seq(range(100))  # needs 7 blocks
    assert not kv.allocate(s, 100, kv.match_prefix(s))
    assert kv.num_free == 4 and s.block_table == [] and s.num_computed_tokens == 0


def test_prefix_hit_reuses_full_blocks_and_leaves_last_token():
    kv = KVCacheManager(num_blocks=32, block_size=16)
    a = computed(kv, range(64))
    assert kv.num_cached == 4
    b = seq(list(range(64)) + [999] * 10)
    hits = kv.match_prefix(b)
    assert hits == a.block_table  # all four full blocks
    same = seq(range(64))
    assert kv.match_prefix(same) == a.block_table[:3]  # the last token is always computed
    assert kv.allocate(b, 10, hits)
    assert b.num_computed_tokens == 64 and b.num_cached_tokens == 64
    assert kv.blocks[a.block_table[0]].ref_count == 2
    assert kv.hit_tokens == 64 and kv.query_tokens == 64 + 74


def test_prefix_match_stops_at_first_difference_and_checks_keys():
    kv = KVCacheManager(num_blocks=32, block_size=4)
    a = computed(kv, range(16))
    b = seq([0, 1, 2, 3, 9, 9, 9, 9, 8, 9, 10, 11, 12])
    assert kv.match_prefix(b) == a.block_table[:1]  # same third block, different parent: no hit
    # A forged hash collision is caught by the key check.
    forged = seq([7, 7, 7, 7, 1])
    kv._hash_blocks(forged, 1)
    kv.hash_to_block[forged.block_hashes[0]] = a.block_table[0]
    assert kv.match_prefix(forged) == []


def test_prefixes_are_shared_only_within_one_cache_salt():
    kv = KVCacheManager(num_blocks=32, block_size=16)
    a = computed(kv, range(64), cache_salt="tenant-a")
    assert kv.match_prefix(seq(list(range(64)) + [1], "tenant-a")) == a.block_table
    assert kv.match_prefix(seq(list(range(64)) + [1], "tenant-b")) == []
    assert kv.match_prefix(seq(list(range(64)) + [1])) == []  # no salt is a namespace of its own
    b = computed(kv, range(64), cache_salt="tenant-b")  # the same tokens, cached again apart
    assert set(a.block_table).isdisjoint(b.block_table) and kv.num_cached == 8


def test_cached_blocks_survive_free_and_are_evicted_lru_only_when_needed():
    kv = KVCacheManager(num_blocks=6, block_size=4)
    old, new = computed(kv, range(8)), computed(kv, range(100, 108))
    old_blocks, new_blocks = list(old.block_table), list(new.block_table)
    kv.free(old)
    kv.free(new)
    assert kv.num_cached == 4 and kv.num_free == 6
    filler = seq(range(200, 208))  # two plain free blocks exist: no eviction
    kv.allocate(filler, 8, kv.match_prefix(filler))
    assert kv.evictions == 0 and kv.num_cached == 4
    extra = seq(range(300, 304))  # needs one more: evicts the least recently freed, tail first
    kv.allocate(extra, 4, kv.match_prefix(extra))
    assert kv.evictions == 1 and extra.block_table == [old_blocks[1]]
    again = seq(list(range(100, 108)) + [5])
    assert kv.match_prefix(again) == new_blocks


def test_fork_shares_blocks_and_copies_partial_block_on_write():
    kv = KVCacheManager(num_blocks=16, block_size=4)
    parent = seq(range(6))  # one full block + a partial one
    kv.allocate(parent, 6, kv.match_prefix(parent))
    parent.num_computed_tokens = 6
    child = parent.fork(1)
    kv.share(parent, child)
    assert [kv.blocks[b].ref_count for b in parent.block_table] == [2, 2]
    for s in (parent, child):
        s.token_ids.append(42)
    assert kv.allocate(child, 1)  # writes position 6, inside the shared partial block
    assert kv.pending_copies == [(parent.block_table[1], child.block_table[1])]
    assert child.block_table[0] == parent.block_table[0] and child.block_table[1] != parent.block_table[1]
    assert kv.allocate(parent, 1)  # now the sole owner: no copy
    assert len(kv.pending_copies) == 1
    kv.free(parent)
    kv.free(child)
    assert kv.num_free == 16


def test_int8_cache_stays_close_to_full_precision():
    from backends.builtin.worker.attention import LayerKV

    full, int8 = filled_cache("auto", torch.float32), filled_cache("int8", torch.float32)
    tables = torch.tensor([[5, 6, 7]])
    for i in (0, 1):
        exact, approx = full.gathered(i, tables, torch.float32), int8.gathered(i, tables, torch.float32)
        bound = exact.abs().amax(dim=-1, keepdim=True) / 127 / 2 + 1e-6  # half a quantization step
        assert ((exact - approx).abs() <= bound).all()
    assert int8.nbytes < full.nbytes / 3.5  # 1 byte + a 4-byte scale per 64 values, against 4 bytes
    assert isinstance(int8, LayerKV)
