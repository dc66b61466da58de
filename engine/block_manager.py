"""Paged KV-cache bookkeeping: fixed-size blocks, block tables, reference counts, prefix cache.

Free blocks wait in an LRU queue (freed to the tail, taken from the head). A freed block keeps
its prefix-cache entry until it is taken for new content, so a later request with the same
prefix can revive it (vLLM v1's BlockPool). Full blocks are keyed by the chain
``(hash of the parent block's key, this block's tokens)``; the dict compares the tokens
exactly, so a hash collision can never hand out the wrong KV.
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass

from engine.sequence import Sequence

_ROOT = 0x5BEC  # parent "hash" of a sequence's first block


@dataclass(slots=True)
class Block:
    block_id: int
    ref_count: int = 0
    key: tuple[int, tuple[int, ...]] | None = None


class BlockManager:
    def __init__(self, num_blocks: int, block_size: int, enable_prefix_caching: bool = True) -> None:
        if num_blocks < 1:
            raise ValueError(f"the KV cache must hold at least one block, got {num_blocks}")
        self.block_size = block_size
        self.num_blocks = num_blocks
        self.enable_prefix_caching = enable_prefix_caching
        self.blocks = [Block(i) for i in range(num_blocks)]
        self.free_queue: OrderedDict[int, None] = OrderedDict((i, None) for i in range(num_blocks))
        self.cached: dict[tuple[int, tuple[int, ...]], int] = {}
        self.prefix_hits = 0
        self.prefix_queries = 0

    # ----------------------------------------------------------------- queries
    @property
    def num_free_blocks(self) -> int:
        return len(self.free_queue)

    def blocks_needed(self, num_tokens: int) -> int:
        return (num_tokens + self.block_size - 1) // self.block_size

    def can_ever_fit(self, num_tokens: int) -> bool:
        return self.blocks_needed(num_tokens) <= self.num_blocks

    # --------------------------------------------------------------- lifecycle
    def _take_free_block(self) -> Block:
        block_id, _ = self.free_queue.popitem(last=False)
        block = self.blocks[block_id]
        if block.key is not None:  # evict its cached content
            if self.cached.get(block.key) == block_id:
                del self.cached[block.key]
            block.key = None
        block.ref_count = 1
        return block

    def _touch(self, block_id: int) -> None:
        block = self.blocks[block_id]
        if block.ref_count == 0:
            del self.free_queue[block_id]
        block.ref_count += 1

    def match_prefix(self, seq: Sequence) -> int:
        """Attach cached blocks for the longest cached prefix; return the tokens they cover.

        At least one token is always left to compute, so the step still yields logits.
        """
        if not self.enable_prefix_caching or seq.block_table:
            return 0
        tokens = seq.token_ids
        max_blocks = (len(tokens) - 1) // self.block_size
        hits: list[int] = []
        hashes: list[int] = []
        for _i, key in self._key_chain(tokens, _ROOT, 0, max_blocks):
            block_id = self.cached.get(key)
            if block_id is None:
                break
            hits.append(block_id)
            hashes.append(hash(key))
        self.prefix_queries += 1
        if hits:
            self.prefix_hits += 1
        for block_id in hits:
            self._touch(block_id)
        seq.block_table = hits
        seq.block_hashes = hashes
        seq.num_hashed_blocks = len(hits)
        return len(hits) * self.block_size

    def _key_chain(self, tokens: list[int], parent: int, start: int, stop: int):
        """``(i, key)`` of full blocks ``start..stop-1``, each key chained to its parent's hash."""
        bs = self.block_size
        for i in range(start, stop):
            key = (parent, tuple(tokens[i * bs : (i + 1) * bs]))
            yield i, key
            parent = hash(key)

    def prompt_block_keys(self, seq: Sequence, first: int, last: int) -> list[tuple[int, tuple[int, ...]]]:
        """Prefix-cache keys of ``seq``'s full blocks ``first..last-1`` (the chain from its start)."""
        known = 0 < first <= len(seq.block_hashes)  # the parent's hash is already on the sequence
        parent = seq.block_hashes[first - 1] if known else _ROOT
        chain = self._key_chain(seq.token_ids, parent, first if known else 0, last)
        return [key for i, key in chain if i >= first]

    def share_prefix(self, src: Sequence, dst: Sequence, num_tokens: int) -> int:
        """Let ``dst`` (a sibling sample) reuse ``src``'s full computed blocks of a common prefix."""
        num_blocks = min(num_tokens - 1, src.num_computed_tokens) // self.block_size
        num_blocks = min(num_blocks, len(src.block_table))
        dst.block_table = list(src.block_table[:num_blocks])
        for block_id in dst.block_table:
            self._touch(block_id)
        return num_blocks * self.block_size

    def can_allocate(self, seq: Sequence, num_new_tokens: int) -> bool:
        needed = self.blocks_needed(seq.num_computed_tokens + num_new_tokens) - len(seq.block_table)
        return needed <= self.num_free_blocks

    def allocate(self, seq: Sequence, num_new_tokens: int) -> None:
        """Grow ``seq``'s block table to hold its computed tokens plus ``num_new_tokens``."""
        needed = self.blocks_needed(seq.num_computed_tokens + num_new_tokens) - len(seq.block_table)
        if needed > self.num_free_blocks:
            raise RuntimeError("allocate() called without can_allocate()")
        for _ in range(max(0, needed)):
            seq.block_table.append(self._take_free_block().block_id)

    def free(self, seq: Sequence) -> None:
        """Release ``seq``'s blocks, tail first, so shared prefixes are evicted last."""
        for block_id in reversed(seq.block_table):
            block = self.blocks[block_id]
            block.ref_count -= 1
            if block.ref_count == 0:
                self.free_queue[block_id] = None
        seq.block_table = []
        seq.block_hashes = []
        seq.num_hashed_blocks = 0

    def trim(self, seq: Sequence) -> None:
        """Drop blocks beyond what ``seq``'s computed tokens need (rejected drafts' slots)."""
        keep = self.blocks_needed(seq.num_computed_tokens)
        while len(seq.block_table) > max(keep, seq.num_hashed_blocks):
            block_id = seq.block_table.pop()
            block = self.blocks[block_id]
            block.ref_count -= 1
            if block.ref_count == 0:
                self.free_queue[block_id] = None

    def cache_full_blocks(self, seq: Sequence) -> None:
        """Register the blocks that ``seq`` has fully computed in the prefix cache."""
        if not self.enable_prefix_caching:
            return
        num_full = min(seq.num_computed_tokens, seq.num_tokens) // self.block_size
        parent = seq.block_hashes[-1] if seq.block_hashes else _ROOT
        stop = min(num_full, len(seq.block_table))
        for i, key in self._key_chain(seq.token_ids, parent, seq.num_hashed_blocks, stop):
            block_id = seq.block_table[i]
            block = self.blocks[block_id]
            if key not in self.cached:
                self.cached[key] = block_id
                block.key = key
            parent = hash(key)
            seq.block_hashes.append(parent)
            seq.num_hashed_blocks = i + 1
