"""KV block accounting for every KV group (docs/design.md §5): the target group and one group per MTP module.

The router side decides which physical blocks each request owns; workers only hold the pools.
Allocation is all-or-nothing across groups, so a failed allocation never leaves a request half-grown.
"""

from __future__ import annotations

from collections import deque


class BlockPool:
    """Free list of one group's blocks."""

    def __init__(self, num_blocks: int) -> None:
        self.num_blocks = num_blocks
        self._free: deque[int] = deque(range(num_blocks))

    @property
    def num_free(self) -> int:
        return len(self._free)

    def take(self, n: int) -> list[int]:
        return [self._free.popleft() for _ in range(n)]

    def give(self, blocks: list[int]) -> None:
        self._free.extend(blocks)


class KVBlockManager:
    def __init__(self, num_groups: int, num_blocks: int, block_size: int, watermark: float = 0.01) -> None:
        self.block_size = block_size
        self.pools = [BlockPool(num_blocks) for _ in range(num_groups)]
        self.watermark_blocks = int(watermark * num_blocks)
        self.tables: dict[str, list[list[int]]] = {}

    def _missing(self, req_id: str, slots: list[int]) -> list[int]:
        table = self.tables.get(req_id) or [[] for _ in self.pools]
        return [max(0, -(-n // self.block_size) - len(t)) for n, t in zip(slots, table)]

    def allocate(self, req_id: str, slots: list[int], keep_watermark: bool = False) -> list[list[int]] | None:
        """Grow the request so group g covers slots[g] positions; returns the new blocks per group.

        None (and no change) when any group lacks blocks. New admissions keep a watermark of free
        blocks so that running requests can still grow without immediate preemption.
        """
        missing = self._missing(req_id, slots)
        reserve = self.watermark_blocks if keep_watermark else 0
        if any(m > pool.num_free - reserve for m, pool in zip(missing, self.pools)):
            return None
        table = self.tables.setdefault(req_id, [[] for _ in self.pools])
        new = [pool.take(m) for m, pool in zip(missing, self.pools)]
        for blocks, fresh in zip(table, new):
            blocks.extend(fresh)
        return new

    def free(self, req_id: str) -> None:
        for pool, blocks in zip(self.pools, self.tables.pop(req_id, [])):
            pool.give(blocks)

    def usage(self) -> list[float]:
        """Fraction of blocks in use, per group."""
        return [1.0 - pool.num_free / pool.num_blocks for pool in self.pools]

    @property
    def all_free(self) -> bool:
        return not self.tables and all(p.num_free == p.num_blocks for p in self.pools)
