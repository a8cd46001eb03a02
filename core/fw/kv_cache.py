"""Paged KV-cache block allocator with automatic prefix caching.

Pure bookkeeping: this module never touches tensors. It decides which physical
block ids each request owns; the model runner turns those ids into slot
mappings and executes the copy-on-write copies reported here.

Prefix caching: once a block is full and its KV has been computed, it is
registered under a hash of (parent block hash, its tokens, extra keys). A
freed block keeps that hash while it waits in the free queue, so a later
request with the same prefix can take it back (a cache hit). The hash is only
dropped when the block is handed out again (lazy eviction), and the free queue
is LRU ordered, so the least recently freed content is evicted first.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field

from fw.sdk.block_hash import hash_block_tokens

__all__ = [
    "BlockPool",
    "KVBlock",
    "KVCacheManager",
    "NoFreeBlocksError",
]


class NoFreeBlocksError(RuntimeError):
    def __init__(self, num_needed: int, num_free: int) -> None:
        super().__init__(f"need {num_needed} free KV-cache blocks but only {num_free} are free")
        self.num_needed = num_needed
        self.num_free = num_free


@dataclass(eq=False)
class KVBlock:
    block_id: int
    ref_cnt: int = 0
    # Set only while this block is the one registered under the hash in the
    # pool's cache map, so `block_hash is not None` means "findable by hash".
    block_hash: int | None = None


class BlockPool:
    """Owns all physical blocks, their reference counts and the prefix cache."""

    def __init__(self, num_blocks: int, enable_caching: bool = True) -> None:
        if num_blocks < 0:
            raise ValueError(f"num_blocks must be >= 0, got {num_blocks}")
        self.num_blocks = num_blocks
        self.enable_caching = enable_caching
        self.blocks = [KVBlock(i) for i in range(num_blocks)]
        # Unreferenced blocks, head = least recently freed = next to reuse.
        # OrderedDict gives O(1) removal from the middle on a cache hit.
        self._free_queue: OrderedDict[int, KVBlock] = OrderedDict((b.block_id, b) for b in self.blocks)
        self._cached_blocks: dict[int, KVBlock] = {}

    def get_new_blocks(self, n: int) -> list[KVBlock]:
        if n > len(self._free_queue):
            raise NoFreeBlocksError(n, len(self._free_queue))
        out = []
        for _ in range(n):
            _, block = self._free_queue.popitem(last=False)
            self._evict(block)
            block.ref_cnt = 1
            out.append(block)
        return out

    def _evict(self, block: KVBlock) -> None:
        # The block's contents are about to be overwritten, so it must stop
        # being discoverable through the prefix cache.
        if block.block_hash is not None:
            del self._cached_blocks[block.block_hash]
            block.block_hash = None

    def touch(self, blocks: Iterable[KVBlock]) -> None:
        for block in blocks:
            if block.ref_cnt == 0:
                # Cache hit on a freed block: it is no longer evictable.
                del self._free_queue[block.block_id]
            block.ref_cnt += 1

    def free_blocks(self, blocks: Iterable[KVBlock]) -> None:
        for block in blocks:
            if block.ref_cnt <= 0:
                raise RuntimeError(f"double free of KV block {block.block_id}")
            block.ref_cnt -= 1
            if block.ref_cnt == 0:
                self._free_queue[block.block_id] = block

    def get_cached_block(self, block_hash: int) -> KVBlock | None:
        return self._cached_blocks.get(block_hash)

    def cache_full_block(self, block: KVBlock, block_hash: int) -> None:
        if not self.enable_caching or block.block_hash == block_hash:
            return
        if block.block_hash is not None:
            raise RuntimeError(f"KV block {block.block_id} is already cached under a different hash")
        # Another block may already hold identical content (computed before
        # the two requests could share it); the first registration wins.
        if block_hash not in self._cached_blocks:
            self._cached_blocks[block_hash] = block
            block.block_hash = block_hash

    def get_num_free_blocks(self) -> int:
        return len(self._free_queue)

    def usage(self) -> float:
        if self.num_blocks == 0:
            return 0.0
        return 1.0 - len(self._free_queue) / self.num_blocks

    def reset_prefix_cache(self) -> bool:
        # A referenced block may be mid-use by a request whose later cache
        # lookups rely on it, so only reset an idle pool.
        if len(self._free_queue) != self.num_blocks:
            return False
        for block in self._cached_blocks.values():
            block.block_hash = None
        self._cached_blocks.clear()
        return True


@dataclass
class _RequestBlocks:
    blocks: list[KVBlock] = field(default_factory=list)
    # Tokens that have a slot; invariant: len(blocks) == cdiv(num_tokens, bs).
    num_tokens: int = 0
    # Hash chain of this request's leading full, computed blocks.
    block_hashes: list[int] = field(default_factory=list)


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


class KVCacheManager:
    """Per-request block tables on top of a BlockPool."""

    def __init__(self, num_blocks: int, block_size: int, enable_prefix_caching: bool = True) -> None:
        if block_size <= 0:
            raise ValueError(f"block_size must be > 0, got {block_size}")
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
        self.pool = BlockPool(num_blocks, enable_caching=enable_prefix_caching)
        self._requests: dict[str, _RequestBlocks] = {}
        self._pending_copies: list[tuple[int, int]] = []
        self.prefix_cache_queries = 0
        self.prefix_cache_hits = 0

    def get_computed_blocks(self, request_id: str, token_ids: Sequence[int], extra_keys: tuple = ()) -> int:
        if self._requests.get(request_id, _RequestBlocks()).blocks:
            raise ValueError(f"request {request_id!r} already has KV blocks")
        if not self.enable_prefix_caching:
            return 0
        bs = self.block_size
        # The last prompt token must always be computed to get logits, so a
        # fully cached prompt still leaves its final block to recompute.
        max_blocks = max(len(token_ids) - 1, 0) // bs
        hits: list[KVBlock] = []
        hashes: list[int] = []
        parent = None
        for i in range(max_blocks):
            parent = hash_block_tokens(parent, token_ids[i * bs : (i + 1) * bs], extra_keys)
            block = self.pool.get_cached_block(parent)
            if block is None:
                break
            hits.append(block)
            hashes.append(parent)
        self.pool.touch(hits)
        num_cached = len(hits) * bs
        self._requests[request_id] = _RequestBlocks(hits, num_cached, hashes)
        self.prefix_cache_queries += len(token_ids)
        self.prefix_cache_hits += num_cached
        return num_cached

    def _plan(self, req: _RequestBlocks, num_tokens: int) -> tuple[int, bool]:
        """(new blocks needed, whether the last block needs copy-on-write)."""
        if num_tokens < req.num_tokens:
            raise ValueError(f"allocate_slots cannot shrink a request ({req.num_tokens} -> {num_tokens})")
        num_new = _cdiv(num_tokens, self.block_size) - len(req.blocks)
        # Writing into a partially filled block that a fork still shares would
        # corrupt the other owner's tokens, so the writer gets a private copy.
        cow = num_tokens > req.num_tokens and req.num_tokens % self.block_size != 0 and req.blocks[-1].ref_cnt > 1
        return num_new, cow

    def can_allocate(self, request_id: str, num_tokens: int) -> bool:
        num_new, cow = self._plan(self._requests.get(request_id, _RequestBlocks()), num_tokens)
        return num_new + cow <= self.pool.get_num_free_blocks()

    def allocate_slots(self, request_id: str, num_tokens: int) -> bool:
        req = self._requests.get(request_id, _RequestBlocks())
        num_new, cow = self._plan(req, num_tokens)
        if num_new + cow > self.pool.get_num_free_blocks():
            return False
        if cow:
            (fresh,) = self.pool.get_new_blocks(1)
            shared = req.blocks[-1]
            req.blocks[-1] = fresh
            # Safe to drop our reference before the copy runs: only a forward
            # pass writes KV and copies execute before it, so the source keeps
            # its contents even if its other owner frees it this step.
            self.pool.free_blocks([shared])
            self._pending_copies.append((shared.block_id, fresh.block_id))
        req.blocks.extend(self.pool.get_new_blocks(num_new))
        req.num_tokens = num_tokens
        self._requests[request_id] = req
        return True

    def cache_blocks(
        self,
        request_id: str,
        token_ids: Sequence[int],
        num_computed_tokens: int,
        extra_keys: tuple = (),
    ) -> None:
        if not self.enable_prefix_caching:
            return
        req = self._requests[request_id]
        if num_computed_tokens > min(req.num_tokens, len(token_ids)):
            raise ValueError(
                f"{num_computed_tokens} computed tokens exceed the request's "
                f"{req.num_tokens} slots or {len(token_ids)} token ids"
            )
        bs = self.block_size
        hashes = req.block_hashes
        # Resume the chain where the previous step stopped.
        for i in range(len(hashes), num_computed_tokens // bs):
            parent = hashes[-1] if hashes else None
            h = hash_block_tokens(parent, token_ids[i * bs : (i + 1) * bs], extra_keys)
            hashes.append(h)
            self.pool.cache_full_block(req.blocks[i], h)

    def fork(self, parent_id: str, child_id: str) -> None:
        if child_id in self._requests:
            raise ValueError(f"request {child_id!r} already exists")
        parent = self._requests[parent_id]
        self.pool.touch(parent.blocks)
        self._requests[child_id] = _RequestBlocks(list(parent.blocks), parent.num_tokens, list(parent.block_hashes))

    def take_pending_copies(self) -> list[tuple[int, int]]:
        copies, self._pending_copies = self._pending_copies, []
        return copies

    def trim(self, request_id: str, num_tokens: int) -> None:
        """Shrink the request's slots to ``num_tokens``: the blocks past them (a verification step's rejected draft
        tokens) go back to the pool. They were never cached: only computed, kept tokens' full blocks are."""
        req = self._requests[request_id]
        keep = _cdiv(num_tokens, self.block_size)
        self.pool.free_blocks(reversed(req.blocks[keep:]))
        del req.blocks[keep:]
        req.num_tokens = num_tokens

    def free(self, request_id: str) -> None:
        req = self._requests.pop(request_id, None)
        if req is not None:
            # Tail first: it reaches the free-queue head sooner, so a
            # sequence's unique suffix is evicted before its shareable prefix.
            self.pool.free_blocks(reversed(req.blocks))

    def block_ids(self, request_id: str) -> list[int]:
        req = self._requests.get(request_id)
        return [] if req is None else [b.block_id for b in req.blocks]

    def num_free_blocks(self) -> int:
        return self.pool.get_num_free_blocks()

    def usage(self) -> float:
        return self.pool.usage()

    def prefix_cache_hit_rate(self) -> float:
        if self.prefix_cache_queries == 0:
            return 0.0
        return self.prefix_cache_hits / self.prefix_cache_queries
