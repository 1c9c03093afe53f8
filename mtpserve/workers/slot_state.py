"""Per-slot batch state resident on the device, and the diffs that keep it current (docs/design.md §8).

The uniform step (mtpserve/workers/uniform_step.py) reads everything it needs from here through the
batch's slot indices: how many tokens each request has verified, its newest token (input to the next
target step), its block table and block capacity in every KV group, and its sampling settings. The
step itself advances `seq_len` and `last_token` on the device, so a run of uniform steps needs nothing
from the host but the slot list and the number of drafts to verify.

The host changes this state only through `StateDiffs`: admissions, appended blocks and the tokens a
general (eager, host-planned) step produced. They travel, with the step's slot list, in one int64
buffer: one pinned host-to-device copy per step.

Slot `pad_slot` (the last) belongs to no request: padded batch rows point at it. Its block capacity
is 0, so nothing it computes is ever written to a KV pool.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import torch

from mtpserve.kernels import use_fused
from mtpserve.kernels.chain_layout_ref import ChainLayout, chain_layout_ref
from mtpserve.kernels.state_scatter_ref import state_scatter_ref
from mtpserve.kernels.window_metadata_ref import window_metadata_ref
from mtpserve.sampling_params import MAX_SPECULATIVE_TOKENS, SamplingParams
from mtpserve.workers.attention import AttentionMetadata
from mtpserve.workers.device import Staging
from mtpserve.workers.sampling import SamplingTensors, top_k_cap

# Rows of `DeviceState.ints`.
SEQ_LEN, LAST_TOKEN, NUM_SPEC, TOP_K, SEED = range(5)
# Rows of `DeviceState.floats`.
TEMPERATURE, TOP_P, MIN_P, REPETITION, PRESENCE, FREQUENCY, GREEDY = range(7)
PAD_SEQ_LEN = 16  # padded rows sit at small valid positions (their KV writes are dropped anyway)


class DeviceState:
    """[slots + 1] tensors (the last slot is padding) on the worker's device."""

    def __init__(self, num_slots: int, num_groups: int, max_blocks: int, block_size: int, vocab: int,
                 device: torch.device) -> None:
        n = num_slots + 1
        self.pad_slot, self.max_blocks, self.block_size, self.vocab = num_slots, max_blocks, block_size, vocab
        self.ints = torch.zeros(5, n, dtype=torch.int64, device=device)
        self.floats = torch.zeros(7, n, dtype=torch.float32, device=device)
        self.tables = torch.zeros(num_groups, n, max_blocks, dtype=torch.int32, device=device)
        self.capacity = torch.zeros(num_groups, n, dtype=torch.int64, device=device)  # positions owned
        self.ints[SEQ_LEN, self.pad_slot] = PAD_SEQ_LEN
        # Neutral settings, which the pad slot keeps (a request's own overwrite them): padded rows sample too, and
        # with a repetition penalty of 0 their logits were divided by 0, their probabilities NaN, and top-p's sort
        # failed on them (CPU, a padded batch with penalties).
        self.floats[[TEMPERATURE, TOP_P, REPETITION]] = 1.0
        self.device = device

    @property
    def seq_len(self) -> torch.Tensor:
        return self.ints[SEQ_LEN]

    @property
    def last_token(self) -> torch.Tensor:
        return self.ints[LAST_TOKEN]

    @property
    def num_spec(self) -> torch.Tensor:
        return self.ints[NUM_SPEC]

    def reset_pad(self) -> None:
        """Padded rows advanced the pad slot last step: put it back (inside the captured step)."""
        self.ints[SEQ_LEN, self.pad_slot :].fill_(PAD_SEQ_LEN)  # a kernel, not a copy from a host scalar

    def sampling(self, slots: torch.Tensor, flags: "SamplingFlags") -> SamplingTensors:
        """The batch rows' sampling settings, gathered on the device; the flags come from the host."""
        f, i = self.floats[:, slots], self.ints[:, slots]
        return SamplingTensors(
            temperature=f[TEMPERATURE], top_k=i[TOP_K], top_p=f[TOP_P], min_p=f[MIN_P], repetition=f[REPETITION],
            presence=f[PRESENCE], frequency=f[FREQUENCY], greedy=f[GREEDY] > 0, seed=i[SEED],
            use_penalties=flags.penalties, use_top_k=flags.top_k_cap > 0, use_top_p=flags.top_p,
            use_min_p=flags.min_p, all_greedy=flags.all_greedy, top_k_cap=flags.top_k_cap or None,
        )

    def upload(self, staging: Staging, head: np.ndarray, diffs: "StateDiffs") -> torch.Tensor:
        """One pinned host-to-device copy of `head` and the diffs, which are scattered here -> head on the device
        (valid until the staging's next upload)."""
        host, counts = diffs.pack(head)
        packed = staging.upload(host)
        self.apply(packed[len(head) :], counts)
        return packed[: len(head)]

    def apply(self, packed: torch.Tensor, counts: tuple[int, int, int, int]) -> None:
        """Scatter a packed diff (see StateDiffs.pack) into the state; counts are the section sizes."""
        if not any(counts):  # most steps at k = 0 change nothing: no kernels at all
            return
        scatter = state_scatter_ref
        if use_fused(packed):  # one launch for every section (imported here, as window_rows does)
            from mtpserve.kernels.state_scatter import state_scatter as scatter
        scatter(packed, counts, self.tables, self.capacity, self.ints, self.floats)


def device_state(num_slots: int, num_groups: int, max_len: int, block_size: int, vocab: int,
                 device: torch.device) -> tuple[DeviceState, "StateDiffs"]:
    """A runner's device-resident state and the diffs that feed it; block tables reach max_len plus the
    furthest a chain drafts past it."""
    max_blocks = -(-(max_len + 2 * MAX_SPECULATIVE_TOKENS) // block_size)
    return (DeviceState(num_slots, num_groups, max_blocks, block_size, vocab, device),
            StateDiffs(num_slots, num_groups, max_blocks, block_size))


def window_rows(state: DeviceState, group: int, slots: torch.Tensor, first_pos: torch.Tensor, q: int,
                limit: torch.Tensor) -> tuple[AttentionMetadata, torch.Tensor]:
    """Attention metadata of one KV group for q rows per request at positions first_pos [B] + 0 .. q - 1,
    and those positions [B * q].

    Row j writes its KV only where j < limit [B] and its position lies inside the blocks the request owns
    in that group; every other row gets slot -1, which the store skips. On CUDA one kernel builds it all
    (a uniform step does this for the target and for every module pass).
    """
    build = window_metadata_ref
    if use_fused(slots):  # imported here: triton is imported only where a kernel runs (tests/kernels/conftest.py)
        from mtpserve.kernels.window_metadata import window_metadata as build
    pos, slot_mapping, seq_lens, qsl = build(state.tables[group], state.capacity[group], slots, first_pos, limit, q,
                                             state.block_size)
    return AttentionMetadata(qsl, seq_lens, state.tables[group, slots], slot_mapping, q,
                             _max_seq_len(state, seq_lens)), pos


def _max_seq_len(state: DeviceState, seq_lens: torch.Tensor) -> int:
    """A bound on seq_lens: it only sizes the CPU reference's gather (a host read there); on CUDA the kernels
    read the lengths on the device, and the table's capacity bounds them without a sync."""
    return int(seq_lens.max()) if not seq_lens.is_cuda else state.max_blocks * state.block_size


def chain_rows(state: DeviceState, slots: torch.Tensor, seq_len: torch.Tensor, accepted: torch.Tensor,
               emitted: torch.Tensor, passes: int) -> ChainLayout:
    """The layout of a uniform step's first `passes` module passes (module p over window + p rows, in KV group
    1 + p), built at once: one kernel on CUDA (mtpserve/kernels/chain_layout_ref.py)."""
    build = chain_layout_ref
    if use_fused(slots):
        from mtpserve.kernels.chain_layout import chain_layout as build
    return build(state.tables, state.capacity, state.num_spec, slots, seq_len, accepted, emitted, passes,
                 state.block_size)


def pass_rows(state: DeviceState, lay: ChainLayout, p: int) -> tuple[AttentionMetadata, torch.Tensor]:
    """Module pass p's attention metadata and positions [B * q] out of the chain's layout (window_rows' form)."""
    span, q = lay.span(p), lay.window + p
    meta = AttentionMetadata(lay.query_start_loc[p], lay.seq_lens[p], lay.block_tables[p], lay.slot_mapping[span],
                             q, _max_seq_len(state, lay.seq_lens[p]))
    return meta, lay.positions[span]


@dataclass(frozen=True)
class SamplingFlags:
    """Which parts of the sampling transform a batch needs (host-side, part of a graph's key)."""

    all_greedy: bool = True
    penalties: bool = False
    top_k_cap: int = 0  # 0: no top-k; else a power of two >= every row's top_k
    top_p: bool = False
    min_p: bool = False


@dataclass
class StateDiffs:
    """Host-side changes to DeviceState since the last step, as (flat index, value) pairs."""

    num_slots: int
    num_groups: int
    max_blocks: int
    block_size: int
    tab: list[tuple[int, int]] = field(default_factory=list)
    cap: list[tuple[int, int]] = field(default_factory=list)
    ints: list[tuple[int, int]] = field(default_factory=list)
    floats: list[tuple[int, float]] = field(default_factory=list)

    def table(self, group: int, slot: int, blocks: list[int], first_col: int) -> None:
        """Blocks appended to a slot's table in one group (first_col = how many it had)."""
        base = (group * (self.num_slots + 1) + slot) * self.max_blocks + first_col
        self.tab += [(base + c, b) for c, b in enumerate(blocks)]
        self.cap.append((group * (self.num_slots + 1) + slot, (first_col + len(blocks)) * self.block_size))

    def int_field(self, row: int, slot: int, value: int) -> None:
        self.ints.append((row * (self.num_slots + 1) + slot, value))

    def float_field(self, row: int, slot: int, value: float) -> None:
        self.floats.append((row * (self.num_slots + 1) + slot, value))

    def tokens(self, slot: int, token_ids: list[int]) -> None:
        """A request's verified tokens as a general step left them."""
        self.int_field(SEQ_LEN, slot, len(token_ids))
        self.int_field(LAST_TOKEN, slot, token_ids[-1])

    def pack(self, head: np.ndarray) -> tuple[np.ndarray, tuple[int, int, int, int]]:
        """-> (int64 buffer: `head` then the diff sections, section sizes); clears the diffs."""
        parts, counts = [head.astype(np.int64)], []
        for pairs, dtype in ((self.tab, np.int64), (self.cap, np.int64), (self.ints, np.int64), (self.floats, np.float64)):
            if not pairs:  # most steps change nothing: skip np.unique's fixed cost (a few us a section)
                counts.append(0)
                continue
            idx, val = _last_writes(np.array(pairs, dtype=dtype).reshape(-1, 2))
            parts += [idx.astype(np.int64), val.view(np.int64) if dtype == np.float64 else val]
            counts.append(len(idx))
        self.tab, self.cap, self.ints, self.floats = [], [], [], []
        return (np.concatenate(parts) if len(parts) > 1 else parts[0]), tuple(counts)


def _last_writes(pairs: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(index, value) pairs -> the last value written to each index (a scatter's order is not defined)."""
    if len(set(pairs[:, 0].tolist())) == len(pairs):  # the usual step (a block or two appended): no repeats,
        return pairs[:, 0], np.ascontiguousarray(pairs[:, 1])  # and np.unique's sort costs more than the rest
    idx, last = np.unique(pairs[::-1, 0], return_index=True)
    return idx, np.ascontiguousarray(pairs[::-1, 1][last])


def sampling_flags(params: list[SamplingParams], vocab: int) -> SamplingFlags:
    """The batch's SamplingFlags, from the requests' settings on the host."""
    return SamplingFlags(
        all_greedy=all(p.greedy for p in params),
        penalties=any(p.uses_penalties for p in params),
        top_k_cap=top_k_cap([p.top_k for p in params], vocab),
        top_p=any(p.top_p < 1.0 for p in params),
        min_p=any(p.min_p > 0.0 for p in params),
    )
