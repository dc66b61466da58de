"""Paged KV-cache bookkeeping: fixed-size blocks, block tables, reference counts, prefix cache.

Free blocks wait in LRU queues (freed to the tail, taken from the head). A freed block keeps
its prefix-cache entry until it is taken for new content, so a later request with the same
prefix can revive it (vLLM v1's BlockPool). Blocks with no cached content are taken first; then
cached ones by retention: a block remembers the most urgent priority of the requests that held
it, and the least urgent level is evicted first, so a bulk sweep reuses its own blocks before it
touches a live conversation's prefix (with ``by_priority``; otherwise one level, plain LRU).

A full block is cached under a digest that chains its tokens to its parent's digest, from a
root that is random per process and mixed with the request's ``cache_salt`` (so tenants with
different salts never share a block). A digest is only a fast index: a hit must also carry
exactly this block's tokens and exactly the parent this sequence already matched (its block id
and generation, which changes when the block is reused), and the first block the same salt, so
even a digest collision can never hand out the wrong KV. A sequence's digests are memoized on it
(its token ids only grow), so the waiting queue can ask every step how much of each waiting
prompt is cached (``cached_prefix_tokens``, read only) without hashing it again.
"""

from __future__ import annotations

import hashlib
import os
from array import array
from collections import OrderedDict
from dataclasses import dataclass
from typing import Iterator

from engine.sequence import Sequence

_PROCESS_ROOT = os.urandom(16)  # parent digest of a sequence's first block (unsalted)

# What a cached block's parent must be: ("salt", cache_salt) for a first block, otherwise the
# parent's (block_id, generation).
ParentRef = tuple


def block_digest(parent: bytes, tokens: tuple[int, ...]) -> bytes:
    """The cache key of a full block: blake2b of its parent's digest and its token ids."""
    return hashlib.blake2b(parent + array("q", tokens).tobytes(), digest_size=16).digest()


def root_digest(cache_salt: str | None) -> bytes:
    """The parent digest of a request's first block: the process root, salted per tenant."""
    if cache_salt is None:
        return _PROCESS_ROOT
    return hashlib.blake2b(_PROCESS_ROOT + b"salt:" + cache_salt.encode(), digest_size=16).digest()


@dataclass(slots=True)
class Block:
    block_id: int
    ref_count: int = 0
    key: bytes | None = None  # the digest it is cached under
    tokens: tuple[int, ...] | None = None  # its content, checked exactly on a hit
    parent: ParentRef | None = None
    generation: int = 0  # bumped each time the block is taken for new content
    retention: int = 0  # most urgent priority among the requests that held it (eviction order)


class BlockManager:
    def __init__(self, num_blocks: int, block_size: int, enable_prefix_caching: bool = True, *,
                 by_priority: bool = False) -> None:
        if num_blocks < 1:
            raise ValueError(f"the KV cache must hold at least one block, got {num_blocks}")
        self.block_size = block_size
        self.num_blocks = num_blocks
        self.enable_prefix_caching = enable_prefix_caching
        self.by_priority = by_priority
        self.blocks = [Block(i) for i in range(num_blocks)]
        # Free blocks with no cached content, and free cached blocks by retention level (LRU each).
        self.empty_free: OrderedDict[int, None] = OrderedDict((i, None) for i in range(num_blocks))
        self.cached_free: dict[int, OrderedDict[int, None]] = {}
        self._num_free = num_blocks
        self.cached: dict[bytes, int] = {}
        self.prefix_hits = 0
        self.prefix_queries = 0

    # ----------------------------------------------------------------- queries
    @property
    def num_free_blocks(self) -> int:
        return self._num_free

    def _level(self, seq: Sequence) -> int:
        return seq.request.priority if self.by_priority else 0

    def blocks_needed(self, num_tokens: int) -> int:
        return (num_tokens + self.block_size - 1) // self.block_size

    def can_ever_fit(self, num_tokens: int) -> bool:
        return self.blocks_needed(num_tokens) <= self.num_blocks

    # --------------------------------------------------------------- lifecycle
    def _release(self, block: Block) -> None:
        """Drop one reference; an unreferenced block joins the tail of its free queue."""
        block.ref_count -= 1
        if block.ref_count == 0:
            if block.key is None:
                self.empty_free[block.block_id] = None
            else:
                self.cached_free.setdefault(block.retention, OrderedDict())[block.block_id] = None
            self._num_free += 1

    def _unfree(self, block: Block) -> None:
        """Take a specific free block out of its queue (a prefix hit revives it)."""
        if block.key is None:
            del self.empty_free[block.block_id]
        else:
            queue = self.cached_free[block.retention]
            del queue[block.block_id]
            if not queue:
                del self.cached_free[block.retention]
        self._num_free -= 1

    def _take_free_block(self, level: int) -> Block:
        """An empty block if any, else the least recently freed of the least urgent level."""
        if self.empty_free:
            block_id, _ = self.empty_free.popitem(last=False)
        else:
            worst = max(self.cached_free)
            queue = self.cached_free[worst]
            block_id, _ = queue.popitem(last=False)
            if not queue:
                del self.cached_free[worst]
        self._num_free -= 1
        block = self.blocks[block_id]
        if block.key is not None:  # evict its cached content
            if self.cached.get(block.key) == block_id:
                del self.cached[block.key]
            block.key = block.tokens = block.parent = None
        block.generation += 1  # children cached under its old content can no longer match
        block.ref_count = 1
        block.retention = level
        return block

    def _touch(self, block_id: int, level: int) -> None:
        block = self.blocks[block_id]
        if block.ref_count == 0:
            self._unfree(block)
        block.ref_count += 1
        block.retention = min(block.retention, level)

    def match_prefix(self, seq: Sequence) -> int:
        """Attach cached blocks for the longest cached prefix; return the tokens they cover.

        At least one token is always left to compute, so the step still yields logits.
        """
        if not self.enable_prefix_caching or seq.block_table:
            return 0
        tokens = seq.token_ids
        bs = self.block_size
        parent: ParentRef = ("salt", seq.request.cache_salt)
        hits: list[int] = []
        hashes: list[tuple[bytes, ParentRef]] = []
        for i, digest in self._prefix_digests(seq, (len(tokens) - 1) // bs):
            block_id = self.cached.get(digest)
            if block_id is None:
                break
            block = self.blocks[block_id]
            if block.parent != parent or block.tokens != tuple(tokens[i * bs : (i + 1) * bs]):
                break  # a digest collision: the content differs
            parent = (block_id, block.generation)
            hits.append(block_id)
            hashes.append((digest, parent))
        self.prefix_queries += 1
        if hits:
            self.prefix_hits += 1
        for block_id in hits:
            self._touch(block_id, self._level(seq))
        seq.block_table = hits
        seq.block_hashes = hashes
        seq.num_hashed_blocks = len(hits)
        return len(hits) * self.block_size

    def cached_prefix_tokens(self, seq: Sequence) -> int:
        """The tokens ``match_prefix`` would attach to ``seq`` now, read only: nothing is attached,
        touched or counted (the waiting queue ranks its head by this every step).

        It walks the memoized digests and stops at the first block not cached or not chained to
        the block before; the content is taken on the digest's word (``match_prefix`` checks it
        exactly when the sequence is admitted), so a digest collision can only misrank.
        """
        if not self.enable_prefix_caching or seq.block_table:
            return 0
        parent: ParentRef = ("salt", seq.request.cache_salt)
        num_hits = 0
        for _i, digest in self._prefix_digests(seq, (seq.num_tokens - 1) // self.block_size):
            block_id = self.cached.get(digest)
            if block_id is None or self.blocks[block_id].parent != parent:
                break
            parent = (block_id, self.blocks[block_id].generation)
            num_hits += 1
        return num_hits * self.block_size

    def _prefix_digests(self, seq: Sequence, stop: int) -> Iterator[tuple[int, bytes]]:
        """``(i, digest)`` of ``seq``'s full blocks ``0..stop-1``, memoized on the sequence and
        extended only as far as the caller reads (a walk that stops at a miss hashes one block
        past its hits, once)."""
        salt = seq.request.cache_salt
        memo = seq.prefix_digests
        if seq.prefix_digests_salt != salt:
            memo.clear()
            seq.prefix_digests_salt = salt
        bs = self.block_size
        tokens = seq.token_ids
        for i in range(stop):
            if i == len(memo):
                parent = memo[-1] if memo else root_digest(salt)
                memo.append(block_digest(parent, tuple(tokens[i * bs : (i + 1) * bs])))
            yield i, memo[i]

    def _key_chain(
        self, tokens: list[int], parent: bytes, start: int, stop: int
    ) -> Iterator[tuple[int, bytes, tuple[int, ...]]]:
        """``(i, digest, tokens)`` of full blocks ``start..stop-1``, each digest chained to its parent's."""
        bs = self.block_size
        for i in range(start, stop):
            block_tokens = tuple(tokens[i * bs : (i + 1) * bs])
            parent = block_digest(parent, block_tokens)
            yield i, parent, block_tokens

    def prompt_block_keys(self, seq: Sequence, first: int, last: int) -> list[bytes]:
        """Prefix-cache digests of ``seq``'s full blocks ``first..last-1`` (the chain from its start)."""
        return [digest for i, digest in self._prefix_digests(seq, last) if i >= first]

    def share_prefix(self, src: Sequence, dst: Sequence, num_tokens: int) -> int:
        """Let ``dst`` (a sibling sample) reuse ``src``'s full computed blocks of a common prefix."""
        num_blocks = min(num_tokens - 1, src.num_computed_tokens) // self.block_size
        num_blocks = min(num_blocks, len(src.block_table))
        dst.block_table = list(src.block_table[:num_blocks])
        for block_id in dst.block_table:
            self._touch(block_id, self._level(dst))
        return num_blocks * self.block_size

    def can_allocate(self, seq: Sequence, num_new_tokens: int) -> bool:
        needed = self.blocks_needed(seq.num_computed_tokens + num_new_tokens) - len(seq.block_table)
        return needed <= self.num_free_blocks

    def allocate(self, seq: Sequence, num_new_tokens: int) -> None:
        """Grow ``seq``'s block table to hold its computed tokens plus ``num_new_tokens``."""
        needed = self.blocks_needed(seq.num_computed_tokens + num_new_tokens) - len(seq.block_table)
        if needed > self.num_free_blocks:
            raise RuntimeError("allocate() called without can_allocate()")
        level = self._level(seq)
        for _ in range(max(0, needed)):
            seq.block_table.append(self._take_free_block(level).block_id)

    def free(self, seq: Sequence) -> None:
        """Release ``seq``'s blocks, tail first, so shared prefixes are evicted last."""
        for block_id in reversed(seq.block_table):
            self._release(self.blocks[block_id])
        seq.block_table = []
        seq.block_hashes = []
        seq.num_hashed_blocks = 0

    def trim(self, seq: Sequence) -> None:
        """Drop blocks beyond what ``seq``'s computed tokens need (rejected drafts' slots)."""
        keep = self.blocks_needed(seq.num_computed_tokens)
        while len(seq.block_table) > max(keep, seq.num_hashed_blocks):
            self._release(self.blocks[seq.block_table.pop()])

    def cache_full_blocks(self, seq: Sequence) -> None:
        """Register the blocks that ``seq`` has fully computed in the prefix cache."""
        if not self.enable_prefix_caching:
            return
        num_full = min(seq.num_computed_tokens, seq.num_tokens) // self.block_size
        if seq.block_hashes:
            digest, parent = seq.block_hashes[-1]
        else:
            salt = seq.request.cache_salt
            digest, parent = root_digest(salt), ("salt", salt)
        stop = min(num_full, len(seq.block_table))
        for i, digest, block_tokens in self._key_chain(seq.token_ids, digest, seq.num_hashed_blocks, stop):
            block_id = seq.block_table[i]
            block = self.blocks[block_id]
            cached_id = self.cached.get(digest)
            if cached_id is None:
                self.cached[digest] = block_id
                block.key, block.tokens, block.parent = digest, block_tokens, parent
                ref = (block_id, block.generation)
            else:
                other = self.blocks[cached_id]
                if other.tokens == block_tokens and other.parent == parent:
                    ref = (cached_id, other.generation)  # the same content is cached: chain through it
                else:
                    ref = (block_id, block.generation)  # a collision: ours stays out of the cache
            seq.block_hashes.append((digest, ref))
            seq.num_hashed_blocks = i + 1
            parent = ref
