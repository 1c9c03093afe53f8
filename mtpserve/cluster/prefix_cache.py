"""Which KV blocks of a request can be reused by another (automatic prefix caching), per KV group.

A full block of the target group covering positions [b*B, (b+1)*B) depends on tokens t_0 .. t_{(b+1)B-1}.
MTP module m's KV entry at position i depends on t_{i+m+1} and on g^{m-1}_i, which itself depends on
t_0 .. t_{i+m} (docs/design.md §3), so a block of module m depends on t_0 .. t_{(b+1)B+m}: m + 1 tokens
past the block. Each group's block hash therefore covers its block's tokens shifted by the group's
lookahead (0 for the target, m + 1 for module m) and the previous block's hash (a chain), so equal
hashes mean equal inputs for every entry of the block.

A block is offered to the cache only once every entry in it is committed (docs/design.md §3: computed
from verified inputs): positions below the target's num_computed, and for module m also below N - m - 1
(N verified tokens). Those entries are never written again, so sharing them is safe.
"""

from __future__ import annotations

from array import array
from hashlib import blake2b

_ROOT = b"mtpserve-prefix-cache-v1"


def group_lookahead(group: int) -> int:
    """Tokens past a block that its entries depend on: 0 for the target (group 0), m + 1 for module m."""
    return group


def num_hashable_blocks(num_tokens: int, block_size: int, lookahead: int) -> int:
    """Full blocks whose every input token is known among `num_tokens` verified tokens."""
    return max(0, (num_tokens - lookahead) // block_size)


def extend_hashes(hashes: list[bytes], token_ids: list[int], block_size: int, lookahead: int, upto: int) -> None:
    """Append the chained hashes of blocks len(hashes) .. upto-1 (token_ids must cover their inputs).

    Block 0 covers t_0 .. t_{B+a-1} (with lookahead a: the module's first entries also depend on the
    tokens the target saw before them); block b > 0 covers t_{bB+a} .. t_{(b+1)B+a-1}. Each block's tokens enter
    its hash as native int64 bytes, the blocks' bytes converted in one go: the offers of full blocks (four groups a
    block at three MTP modules) took about a fifth of the host-only engine's step at c = 128 (session AN).
    """
    first = len(hashes)
    if first >= upto:
        return
    lo = 0 if first == 0 else first * block_size + lookahead
    data = array("q", token_ids[lo : upto * block_size + lookahead]).tobytes()  # int64, native order
    parent = hashes[-1] if hashes else _ROOT + bytes([lookahead])
    end = 0
    for b in range(first, upto):
        start, end = end, end + 8 * (block_size + lookahead if b == 0 else block_size)
        parent = blake2b(parent + data[start:end], digest_size=16).digest()
        hashes.append(parent)
