"""KV block accounting for every KV group (docs/design.md §5): the target group and one group per MTP module.

The router side decides which physical blocks each request owns; workers only hold the pools.
Allocation is all-or-nothing across groups, so a failed allocation never leaves a request half-grown.

With prefix caching (mtpserve/cluster/prefix_cache.py) a full, committed block keeps its hash after its
request lets go of it: it then sits, unreferenced, in its group's LRU list, and a later request whose
tokens hash the same takes it (reference count + 1) instead of computing it. Blocks are handed out
from the never-cached free list first, then by evicting the least recently freed cached block; a block
with a reference is never handed out.
"""

from __future__ import annotations

import sys

from collections import OrderedDict, deque

from mtpserve.cluster.prefix_cache import extend_hashes, group_lookahead, num_hashable_blocks


class BlockPool:
    """One group's blocks: free list, reference counts, and the hash -> block map of its cached blocks."""

    def __init__(self, num_blocks: int) -> None:
        self.num_blocks = num_blocks
        self._free: deque[int] = deque(range(num_blocks))  # unreferenced, no hash
        self._refs = [0] * num_blocks
        self._block_of: dict[bytes, int] = {}
        self._hash_of: dict[int, bytes] = {}
        self._lru: OrderedDict[int, None] = OrderedDict()  # unreferenced cached blocks, least recently freed first
        self.num_evictions = 0

    @property
    def num_free(self) -> int:
        """Blocks that can be handed out: never-cached ones plus evictable cached ones."""
        return len(self._free) + len(self._lru)

    @property
    def num_cached(self) -> int:
        return len(self._block_of)

    def take(self, n: int) -> list[int]:
        blocks = []
        for _ in range(n):
            if self._free:
                block = self._free.popleft()
            else:  # evict the least recently freed cached block
                block, _ = self._lru.popitem(last=False)
                del self._block_of[self._hash_of.pop(block)]
                self.num_evictions += 1
            self._refs[block] = 1
            blocks.append(block)
        return blocks

    def give(self, blocks: list[int]) -> None:
        """Drop one reference to each block; the tail of a request goes first, so it is evicted first."""
        for block in reversed(blocks):
            self._refs[block] -= 1
            if self._refs[block] == 0:
                if block in self._hash_of:
                    self._lru[block] = None
                else:
                    self._free.append(block)

    def lookup(self, hashes: list[bytes], limit: int) -> list[int]:
        """The cached blocks of the leading hashes (at most `limit`), up to the first miss."""
        blocks = []
        for h in hashes[:limit]:
            block = self._block_of.get(h)
            if block is None:
                break
            blocks.append(block)
        return blocks

    def share(self, blocks: list[int]) -> None:
        for block in blocks:
            if self._refs[block] == 0:
                del self._lru[block]
            self._refs[block] += 1

    def register(self, block: int, block_hash: bytes) -> None:
        """Offer a full committed block to the cache (a copy computed meanwhile elsewhere keeps the hash)."""
        if block_hash not in self._block_of and block not in self._hash_of:
            self._block_of[block_hash] = block
            self._hash_of[block] = block_hash

    def forget_cached(self) -> None:
        """Drop every cached hash (the KV they named is gone): unreferenced cached blocks become free."""
        self._free.extend(self._lru)
        self._lru.clear()
        self._block_of.clear()
        self._hash_of.clear()

    def audit(self, tables: list[list[int]]) -> list[str]:
        """Inconsistencies between the reference counts, the free lists and the given block tables."""
        uses = [0] * self.num_blocks
        for table in tables:
            for block in table:
                uses[block] += 1
        problems = [f"block {b}: {self._refs[b]} references, {u} uses" for b, u in enumerate(uses) if u != self._refs[b]]
        problems += [f"block {b} is free and in use" for b in list(self._free) + list(self._lru) if uses[b]]
        if len(set(self._free) | set(self._lru)) + sum(u > 0 for u in uses) != self.num_blocks:
            problems.append("some block is neither free, cached nor in use (leaked), or listed twice")
        return problems


class KVBlockManager:
    def __init__(self, num_groups: int, num_blocks: int, block_size: int, watermark: float = 0.01,
                 enable_caching: bool = False) -> None:
        self.block_size = block_size
        self.pools = [BlockPool(num_blocks) for _ in range(num_groups)]
        self.watermark_blocks = int(watermark * num_blocks)
        self.enable_caching = enable_caching
        self.tables: dict[str, list[list[int]]] = {}
        self._offered: dict[str, list[int]] = {}  # per request, per group: leading blocks already offered
        self._next_offer: dict[str, int] = {}  # num_computed at which some group may have a new full block
        # Prefix-cache counters per group (cumulative): tokens of admitted requests queried, tokens served.
        self.queries, self.hits = [0] * num_groups, [0] * num_groups
        self._reported = ([0] * num_groups, [0] * num_groups)

    def _missing(self, req_id: str, slots: list[int]) -> list[int]:
        table = self.tables.get(req_id) or [[] for _ in self.pools]
        return [max(0, -(-n // self.block_size) - len(t)) for n, t in zip(slots, table)]

    def allocate(self, req_id: str, slots: list[int], keep_watermark: bool = False) -> list[list[int]] | None:
        """Grow the request so group g covers slots[g] positions; returns the new blocks per group.

        None (and no change) when any group lacks blocks. New admissions keep a watermark of free
        blocks so that running requests can still grow without immediate preemption.
        """
        table = self.tables.get(req_id)
        if table is not None and all(n <= len(t) * self.block_size for n, t in zip(slots, table)):
            return [[] for _ in table]  # the usual decode step: its blocks already cover it
        missing = self._missing(req_id, slots)
        reserve = self.watermark_blocks if keep_watermark else 0
        if any(m > pool.num_free - reserve for m, pool in zip(missing, self.pools)):
            return None
        table = self.tables.setdefault(req_id, [[] for _ in self.pools])
        new = [pool.take(m) for m, pool in zip(missing, self.pools)]
        for blocks, fresh in zip(table, new):
            blocks.extend(fresh)
        return new

    def allocate_all(self, wanted: list[tuple[str, list[int]]]) -> list[list[list[int]]] | None:
        """allocate(req_id, slots) for each of `wanted`, all or none: None (and no change) when the pools
        cannot hold them all. A plan that is dropped must not leave blocks the workers never heard of."""
        missing = [self._missing(req_id, slots) for req_id, slots in wanted]
        if any(sum(need) > pool.num_free for need, pool in zip(zip(*missing), self.pools)):
            return None
        return [self.allocate(req_id, slots) for req_id, slots in wanted]

    def share_cached_prefix(self, req_id: str, token_ids: list[int], hashes: list[list[bytes]],
                            groups: tuple[int, ...]) -> int:
        """Give a request (holding no blocks) the cached blocks of its longest prefix that every group in
        `groups` holds; returns the positions they cover (a multiple of the block size, 0 on a miss).

        All groups start from the same frontier: module m's first computed position needs the target's
        and module m-1's hidden states there, which no cache holds. At least one token is left to
        compute, since its logits sample the next token.
        """
        if not self.enable_caching:
            return 0
        n, bs = len(token_ids), self.block_size
        limit = (n - 1) // bs
        found: dict[int, list[int]] = {}
        for g in groups:
            upto = min(limit, num_hashable_blocks(n, bs, group_lookahead(g)))
            extend_hashes(hashes[g], token_ids, bs, group_lookahead(g), upto)
            found[g] = self.pools[g].lookup(hashes[g], limit)
            limit = len(found[g])
            if limit == 0:
                return 0
        table = self.tables.setdefault(req_id, [[] for _ in self.pools])
        for g in groups:
            self.pools[g].share(found[g][:limit])
            table[g].extend(found[g][:limit])
        self._offered[req_id] = [limit if g in groups else 0 for g in range(len(self.pools))]
        self._next_offer[req_id] = (limit + 1) * bs
        return limit * bs

    def count_admission(self, groups: tuple[int, ...], num_tokens: int, num_cached: int) -> None:
        if self.enable_caching:
            for g in groups:
                self.queries[g] += num_tokens
                self.hits[g] += num_cached

    def take_counts(self) -> tuple[list[int], list[int]]:
        """(queries, hits) per group since the last call."""
        (queries, hits), self._reported = self._reported, (list(self.queries), list(self.hits))
        return [a - b for a, b in zip(self.queries, queries)], [a - b for a, b in zip(self.hits, hits)]

    def offer_due(self, req_id: str, num_computed: int) -> bool:
        """Whether offer_committed could find a newly full block (asked per request and step: cheap)."""
        return self.enable_caching and num_computed >= self._next_offer.get(req_id, 0)

    def offer_committed(self, req_id: str, token_ids: list[int], num_computed: int, hashes: list[list[bytes]],
                        groups: tuple[int, ...], module_limit: int | None = None, final: bool = False) -> None:
        """Offer the request's newly full, committed blocks to the cache (cheap when there are none).

        module_limit: the MTP groups (1, 2, ...) are offered only below it (their modules may lag past it).
        final: the request finishes; offer what is committed and hashable even where not yet due.
        """
        if not (final or self.offer_due(req_id, num_computed)):
            return
        bs, n = self.block_size, len(token_ids)
        offered = self._offered.setdefault(req_id, [0] * len(self.pools))
        table = self.tables[req_id]
        for g in groups:
            a = group_lookahead(g)
            limit = num_computed if g == 0 or module_limit is None else min(num_computed, module_limit)
            upto = min(limit // bs, num_hashable_blocks(n, bs, a), len(table[g]))
            if upto > offered[g]:
                extend_hashes(hashes[g], token_ids, bs, a, upto)
                for b in range(offered[g], upto):
                    self.pools[g].register(table[g][b], hashes[g][b])
                offered[g] = upto
        # Due again once every group's next block can be full and hashable, for all of them in one call: a
        # module's block waits for its lookahead's tokens, and due group by group, a request running four
        # modules came here five times a block (on the 2-core CPU at c = 256 the offers were most of what the
        # host's step grew by from k = 0 to k = 4). A module capped by module_limit never gets past it.
        # The target's block waits for the modules' lookahead (a few tokens) before it is offered.
        due = [g for g in groups if g == 0 or module_limit is None or module_limit >= (offered[g] + 1) * bs]
        self._next_offer[req_id] = (min((offered[g] + 1) * bs for g in due) + max(map(group_lookahead, due))
                                    if due else sys.maxsize)

    def forget_cached(self) -> None:
        """The workers holding the pools were replaced: no cached block holds KV any more."""
        for pool in self.pools:
            pool.forget_cached()

    def free(self, req_id: str) -> None:
        self._offered.pop(req_id, None)
        self._next_offer.pop(req_id, None)
        for pool, blocks in zip(self.pools, self.tables.pop(req_id, [])):
            pool.give(blocks)

    def usage(self) -> list[float]:
        """Fraction of blocks in use (referenced by a request), per group; cached free blocks count as free."""
        return [1.0 - pool.num_free / pool.num_blocks for pool in self.pools]

    @property
    def all_free(self) -> bool:
        """No request holds a block: every block is free or cached (and free)."""
        return not self.tables and all(p.num_free == p.num_blocks for p in self.pools)

    def audit(self) -> list[str]:
        """Reference counts against the block tables, per group (for tests: empty when consistent)."""
        return [f"group {g}: {p}" for g, pool in enumerate(self.pools)
                for p in pool.audit([t[g] for t in self.tables.values()])]
