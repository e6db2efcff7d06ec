"""Paged KV cache bookkeeping: a pool of fixed-size blocks, block tables and prefix caching.

Invariants:
- A block is either in use (`ref_count > 0`, in no free list) or free (`ref_count == 0`):
  free blocks holding a cached prefix sit in `cached_free` in LRU order (oldest first), the
  others in `plain_free`. So a cached block is evicted only when no plain block is left.
- Only full blocks are hashed, computed or being computed in the current step. A block's hash
  chains its parent's hash with its own token ids, so equal hashes mean equal prefixes; the
  stored key guards against collisions. The first block's chain starts from the sequence's cache
  salt and LoRA adapter, so prefixes are shared only among sequences of one salt and one adapter's
  weights (an adapter's K/V differ from the base's for the same tokens).
- A block is written only while its owner is its sole user: a shared partial block (left by
  a fork for `n > 1`) is copied before the write (`pending_copies`, done by the model runner).
"""

from __future__ import annotations

from collections import OrderedDict, deque
from dataclasses import dataclass

from backends.builtin.core.sequence import Sequence

# (parent hash, or for the first block its namespace: the cache salt and the adapter; token ids)
BlockKey = tuple[int | tuple[str | None, int], tuple[int, ...]]


@dataclass(eq=False)
class Block:
    block_id: int
    ref_count: int = 0
    hash: int | None = None
    key: BlockKey | None = None


class KVCacheManager:
    def __init__(self, num_blocks: int, block_size: int, enable_prefix_caching: bool = True) -> None:
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
        self.blocks = [Block(i) for i in range(num_blocks)]
        self.plain_free: deque[int] = deque(range(num_blocks))
        self.cached_free: OrderedDict[int, None] = OrderedDict()
        self.hash_to_block: dict[int, int] = {}
        self.pending_copies: list[tuple[int, int]] = []  # (src, dst) for copy-on-write
        self.query_tokens = 0  # prompt tokens looked up in the prefix cache
        self.hit_tokens = 0  # of which found
        self.evictions = 0

    # -- accounting ---------------------------------------------------------------------
    @property
    def num_blocks(self) -> int:
        return len(self.blocks)

    @property
    def num_free(self) -> int:
        return len(self.plain_free) + len(self.cached_free)

    @property
    def num_used(self) -> int:
        return self.num_blocks - self.num_free

    @property
    def num_cached(self) -> int:
        return len(self.hash_to_block)

    def blocks_for(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    # -- prefix cache -------------------------------------------------------------------
    def _key(self, seq: Sequence, i: int) -> BlockKey:
        parent = seq.block_hashes[i - 1] if i else (seq.cache_salt, seq.adapter_id)
        return parent, tuple(seq.token_ids[i * self.block_size : (i + 1) * self.block_size])

    def _hash_blocks(self, seq: Sequence, num_blocks: int) -> None:
        """Extend the chain of block hashes of `seq` to its first `num_blocks` blocks."""
        for i in range(len(seq.block_hashes), num_blocks):
            seq.block_hashes.append(hash(self._key(seq, i)))

    def match_prefix(self, seq: Sequence) -> list[int]:
        """Ids of cached blocks holding a prefix of `seq`; the last token is always left to compute.
        No hits for a sequence that must compute every token (mean pooling: `Sequence.reads_prefix_cache`)."""
        if not self.enable_prefix_caching or not seq.reads_prefix_cache:
            return []
        num_blocks = (len(seq) - 1) // self.block_size
        self._hash_blocks(seq, num_blocks)
        hits = []
        for i in range(num_blocks):
            block_id = self.hash_to_block.get(seq.block_hashes[i])
            if block_id is None or self.blocks[block_id].key != self._key(seq, i):
                break
            hits.append(block_id)
        return hits

    def cache_full_blocks(self, seq: Sequence, num_tokens: int) -> None:
        """Register the blocks of `seq` that its first `num_tokens` tokens fill, so later requests
        can hit them. The scheduler registers them when it schedules their computation: a request
        admitted later in the same step shares them, because a step writes every new token's K/V
        of a layer before any attention of that layer reads the cache."""
        if not self.enable_prefix_caching:
            return
        num_full = num_tokens // self.block_size
        self._hash_blocks(seq, num_full)
        for i in range(seq.num_registered_blocks, num_full):
            h, block = seq.block_hashes[i], self.blocks[seq.block_table[i]]
            if block.hash is None and h not in self.hash_to_block:
                block.hash, block.key = h, self._key(seq, i)
                self.hash_to_block[h] = block.block_id
        seq.num_registered_blocks = num_full

    # -- allocation ---------------------------------------------------------------------
    def _take_free_block(self) -> Block:
        if self.plain_free:
            block = self.blocks[self.plain_free.popleft()]
        else:  # evict the least recently used cached block
            block = self.blocks[self.cached_free.popitem(last=False)[0]]
            del self.hash_to_block[block.hash]
            block.hash = block.key = None
            self.evictions += 1
        block.ref_count = 1
        return block

    def _touch(self, block_id: int) -> None:
        block = self.blocks[block_id]
        if block.ref_count == 0:
            del self.cached_free[block_id]
        block.ref_count += 1

    def allocate(self, seq: Sequence, num_new_tokens: int, hits: list[int] | None = None) -> bool:
        """Make room for `num_new_tokens` more tokens of `seq`. On admission from the waiting
        queue, `hits` are its prefix-cache blocks (from `match_prefix`). All or nothing:
        returns False and changes nothing if the free blocks do not suffice."""
        admission, hits = hits is not None, hits or []
        bs = self.block_size
        cached = len(hits) * bs
        first_write = seq.num_computed_tokens + cached
        need = self.blocks_for(first_write + num_new_tokens) - len(seq.block_table) - len(hits)
        write_block = first_write // bs
        copy_on_write = (
            write_block < len(seq.block_table)
            and self.blocks[seq.block_table[write_block]].ref_count > 1
        )
        revived = sum(self.blocks[b].ref_count == 0 for b in hits)
        if max(need, 0) + copy_on_write + revived > self.num_free:
            return False
        for block_id in hits:
            self._touch(block_id)
        if hits:
            seq.block_table.extend(hits)
            seq.num_computed_tokens += cached
        if admission and seq.num_preemptions == 0 and seq.reads_prefix_cache:  # a query of the cache
            self.query_tokens += len(seq)
            self.hit_tokens += cached
            seq.num_cached_tokens = cached
        if copy_on_write:
            src = self.blocks[seq.block_table[write_block]]
            src.ref_count -= 1
            dst = self._take_free_block()
            self.pending_copies.append((src.block_id, dst.block_id))
            seq.block_table[write_block] = dst.block_id
        for _ in range(need):
            seq.block_table.append(self._take_free_block().block_id)
        return True

    def share(self, parent: Sequence, child: Sequence) -> None:
        """`child` (a fork) uses all of `parent`'s blocks too."""
        child.block_table = list(parent.block_table)
        for block_id in child.block_table:
            self.blocks[block_id].ref_count += 1

    def free(self, seq: Sequence) -> None:
        """Release the blocks of `seq`, tail first, so its last blocks are evicted first."""
        for block_id in reversed(seq.block_table):
            block = self.blocks[block_id]
            block.ref_count -= 1
            if block.ref_count == 0:
                if block.hash is None:
                    self.plain_free.append(block_id)
                else:
                    self.cached_free[block_id] = None
        seq.block_table = []
        seq.num_computed_tokens = seq.num_registered_blocks = 0

    def reset_prefix_cache(self) -> None:
        """Forget every cached prefix (blocks in use keep their data)."""
        for block in self.blocks:
            block.hash = block.key = None
        self.plain_free.extend(self.cached_free)
        self.cached_free.clear()
        self.hash_to_block.clear()
