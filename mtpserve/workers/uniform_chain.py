"""The MTP chain of a uniform step at fixed shapes (docs/design.md §3 and §8).

Notation of one request: N verified tokens before the step (t_{N-1} newest), a drafts accepted, so
N' = N + a + 1 after it, and the drafting position is p = N' - 2.

Module m (a module pass of the chain) has committed positions [0, N - m - 1) before the step and
must compute N - m - 1 .. p: a + m + 1 positions. It runs `window + m` rows per request at positions
N - m - 1 + j, whatever a is:
  * token input t_{i+m+1} of row j is seq[j] = t_{N+j}: the emitted tokens for j <= a, then this
    step's new drafts (row a + m, the drafting row, reads new draft m - 1, sampled by module m - 1);
  * hidden input of row j: module m - 1's output at the same position, i.e. its row j - 1, and for
    row 0 the carried g^{m-1} of module m - 1's last committed position (m = 0: target row j);
  * rows past a + m compute garbage at positions > p; their KV is overwritten next step, which
    recomputes from N' - m - 1 <= p, before anything reads it (or dropped, past the owned blocks).
After the pass, row a holds g^m at N' - m - 2, module m's new last committed position: the carry.
Recursive steps (EAGLE style, or past the last module) run one row at p + offset from the previous
step's output. Every request with num_spec <= j ignores chain step j (its KV writes are dropped).

Where the chain's steps run is the link's business (`ChainLink`): in one process every step runs here
(`LocalLink`, no messages); in a drafter group (docs/design.md §2) each rank runs the steps of the
modules it owns, and the link hands the chain on between owners (mtpserve/workers/group_links.py). A
rank that runs module m also keeps module m - 1's carry (module m's first hidden row next step), made
from the rows it took over, so that each rank holds every carry its modules read.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Protocol

import torch
from torch import nn

from mtpserve.kernels.chain_layout_ref import ChainLayout
from mtpserve.workers.attention import LayerKV
from mtpserve.workers.chain import ChainStep, chain_steps
from mtpserve.workers.models.mtp import MTPStack
from mtpserve.workers.sampling import SamplingTensors, apply_penalties, argmax_rows, sample_draft
from mtpserve.workers.slot_state import DeviceState, SamplingFlags, chain_rows, pass_rows, window_rows
from mtpserve.workers.state import SlotBuffers

if TYPE_CHECKING:
    from mtpserve.workers.uniform_step import StepShape

# A draft position's top-M proposal ids and probabilities [B, M], or (None, None) for a greedy batch.
Proposal = tuple[torch.Tensor, torch.Tensor] | tuple[None, None]


class ChainLink(Protocol):
    """Which chain steps run in this process, and how the chain moves to and from the others."""

    def owns(self, module: int) -> bool: ...

    def take_over(self, run: "ChainRun", j: int) -> None:
        """Before step j, whose previous step ran elsewhere: adopt what that step's owner handed on."""

    def hand_over(self, run: "ChainRun", j: int) -> None:
        """After step j, whose next step runs elsewhere: send what the next owner reads."""

    def deliver(self, run: "ChainRun") -> None:
        """The chain ended here: its drafts (and proposals) to whoever verifies them."""


class LocalLink:
    """Every module in this process: nothing to hand on, and the verifier reads the slots."""

    def owns(self, module: int) -> bool:
        return True

    def take_over(self, run: "ChainRun", j: int) -> None:
        raise AssertionError("a local chain never changes hands")

    def hand_over(self, run: "ChainRun", j: int) -> None:
        raise AssertionError("a local chain never changes hands")

    def deliver(self, run: "ChainRun") -> None:
        pass


@dataclass
class ChainRun:
    """One step's chain in flight: what every chain step reads, and what it leaves for the next."""

    slots: torch.Tensor  # [B]
    steps: list[ChainStep]
    lay: ChainLayout
    sampler: "DraftSampler"
    old_carry: torch.Tensor  # [B, modules, H]: the carries before this step
    spec: torch.Tensor | None  # [B] each request's chain length (only when recursive steps follow)
    prev: torch.Tensor | None  # the last window pass's output rows [B, q, H] (module 0: the target's)
    last: torch.Tensor | None = None  # [B, H] the previous step's row at the drafting position
    drafts: list[torch.Tensor] = field(default_factory=list)  # [B] each
    proposals: list[Proposal] = field(default_factory=list)
    carry: list[tuple[int, torch.Tensor]] = field(default_factory=list)  # (module, its new carry row [B, H])

    @property
    def window(self) -> int:
        return self.lay.window

    @property
    def greedy(self) -> bool:
        return self.sampler.flags.all_greedy

    def add_draft(self, j: int, token: torch.Tensor, ids: torch.Tensor | None, probs: torch.Tensor | None) -> None:
        self.drafts.append(token)
        self.proposals.append((ids, probs))
        if j + 1 < len(self.steps) and self.steps[j + 1].offset == 0:  # the next module pass reads this draft
            self.lay.tokens.view(-1).scatter_(0, self.lay.draft_at[j], token)

    def adopt(self, module: int, rows: torch.Tensor, drafts: torch.Tensor, ids: torch.Tensor | None,
              probs: torch.Tensor | None) -> None:
        """Take over after `module`'s window pass ran elsewhere: its output rows [B, q, H] and the drafts
        [B, j] (and proposals [B, j, M]) so far. Module `module`'s new carry is kept here too."""
        self.prev = rows
        self.carry.append((module, rows.reshape(-1, rows.shape[-1]).index_select(0, self.lay.rows[module, 1])))
        self.drafts, self.proposals = [], []  # the ones sampled here before are among them
        for j in range(drafts.shape[1]):
            self.add_draft(j, drafts[:, j], None if ids is None else ids[:, j], None if probs is None else probs[:, j])
        self.sampler.count(drafts)

    def stacked(self) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor | None]:
        """The drafts so far [B, j], with their proposal ids and probabilities [B, j, M] (None: greedy)."""
        drafts = torch.stack(self.drafts, 1)
        if self.proposals[0][0] is None:
            return drafts, None, None
        return drafts, torch.stack([i for i, _ in self.proposals], 1), torch.stack([p for _, p in self.proposals], 1)


class UniformChain:
    def __init__(self, mtp: MTPStack, embed: nn.Embedding, head: nn.Linear, kv: list[LayerKV],
                 buffers: SlotBuffers, state: DeviceState, mode: str, top_m: int, num_modules: int,
                 link: ChainLink | None = None) -> None:
        self.mtp, self.embed, self.head, self.kv = mtp, embed, head, kv
        self.buffers, self.state, self.mode, self.top_m, self.num_modules = buffers, state, mode, top_m, num_modules
        self.link: ChainLink = link or LocalLink()

    def __call__(self, slots: torch.Tensor, seq_len: torch.Tensor, frontier: torch.Tensor, accepted: torch.Tensor,
                 emitted: torch.Tensor, target_rows: torch.Tensor | None, shape: "StepShape",
                 samp: SamplingTensors) -> None:
        """emitted [B, w] (valid up to index a), target_rows [B, w, H]: hidden for module 0 (None where module 0
        runs elsewhere); frontier [B]: the verified tokens after the step (N + a + 1).

        Kernels are counted here: on small models a module pass is mostly launches, so the glue between
        passes is built once per step (one kernel lays out every window pass: positions, KV slots, block
        tables, the rows to read back; the token rows are written in place as drafts come; the carries
        are read and written once)."""
        link, steps = self.link, chain_steps(shape.chain, self.num_modules, self.mode)
        if not any(link.owns(step.module) for step in steps):
            return  # a drafter rank none of whose modules this chain reaches
        recursive = any(step.offset for step in steps)
        lay = chain_rows(self.state, slots, seq_len, accepted, emitted, sum(step.offset == 0 for step in steps))
        run = ChainRun(slots, steps, lay, DraftSampler(self, slots, frontier, samp, shape.flags),
                       self.buffers.carry[slots], self.state.num_spec[slots] if recursive else None, target_rows)
        for j, step in enumerate(steps):
            if not link.owns(step.module):
                continue
            if j and not link.owns(steps[j - 1].module):
                link.take_over(run, j)
            if step.offset == 0:
                g = self._window_pass(run, step.module, recursive)
            else:
                g = self._recursive_step(run, j, step, frontier)
            run.add_draft(j, *run.sampler(j, self.mtp.logits(step.module, g, self.head, fp32=run.sampler.needs_fp32)))
            if j + 1 < len(steps) and not link.owns(steps[j + 1].module):
                link.hand_over(run, j)
        if link.owns(steps[-1].module):
            link.deliver(run)
            self.store_drafts(slots, torch.stack(run.drafts, 1), run.proposals)
        self.store_carry(slots, run.carry, lay.used, run.old_carry)

    def _window_pass(self, run: ChainRun, m: int, recursive: bool) -> torch.Tensor:
        """Module m over window + m rows per request -> g at the drafting row [B, H]; keeps its carry."""
        batch, q = len(run.slots), run.window + m
        meta, pos = pass_rows(self.state, run.lay, m)
        # Hidden row j is module m - 1's row j - 1, and row 0 its carry (module 0: target row j).
        g = self.mtp(m, run.lay.tokens[:, :q], run.prev, pos, meta, self.kv[m], self.embed,
                     first_hidden=None if m == 0 else run.old_carry[:, m - 1]).view(batch, q, -1)
        run.prev = self.mtp.next_hidden(m, g)
        g, kept, run.last = _read_back(g, run.prev, run.lay.rows[m], recursive)
        run.carry.append((m, kept))
        return g

    def _recursive_step(self, run: ChainRun, j: int, step: ChainStep, frontier: torch.Tensor) -> torch.Tensor:
        """One row at p + offset from the previous step's output and draft -> g [B, H]."""
        m = step.module
        reach = (run.spec > j).long()  # rows past a request's own chain write nothing
        meta, pos = window_rows(self.state, 1 + m, run.slots, frontier - 2 + step.offset, 1, reach)
        g = self.mtp(m, run.drafts[j - 1], run.last, pos, meta, self.kv[m], self.embed)
        run.last = self.mtp.next_hidden(m, g)
        return g

    def store(self, slots: torch.Tensor, drafts: torch.Tensor, proposals: list[Proposal], carry: list[torch.Tensor],
              used: torch.Tensor | None, old_carry: torch.Tensor) -> None:
        """Write drafts, proposals and carries into the slots after the chain; carry lists modules 0, 1, ...
        in order (see store_carry)."""
        self.store_drafts(slots, drafts, proposals)
        self.store_carry(slots, list(enumerate(carry)), used, old_carry)

    def store_drafts(self, slots: torch.Tensor, drafts: torch.Tensor, proposals: list[Proposal]) -> None:
        """Drafts [B, k] and their proposals (absent when every row is greedy: greedy verification never
        reads them)."""
        if proposals and proposals[0][0] is not None:
            self.buffers.put_drafts(slots, drafts, torch.stack([ids for ids, _ in proposals], 1),
                                    torch.stack([probs for _, probs in proposals], 1))
        else:
            self.buffers.put_drafts(slots, drafts)

    def store_carry(self, slots: torch.Tensor, carry: list[tuple[int, torch.Tensor]], used: torch.Tensor | None,
                    old_carry: torch.Tensor) -> None:
        """carry: (module, its g^m row [B, H]) in ascending modules; used [>= modules, B]: whether the request's
        chain reached the module; old_carry [B, modules, H] is what they held before the step. Modules that
        follow each other are written at once (in one process: all of them)."""
        while carry:
            first, n = carry[0][0], 1
            while n < len(carry) and carry[n][0] == first + n:
                n += 1
            rows = torch.stack([row for _, row in carry[:n]], 1)
            span = slice(first, first + n)
            self.buffers.carry[slots, span] = torch.where(used[span].T[..., None], rows, old_carry[:, span])
            carry = carry[n:]


def _read_back(g: torch.Tensor, prev: torch.Tensor, rows: torch.Tensor, recursive: bool
               ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """After a window pass (g, prev [B, q, H]; rows [2, B]: flat drafting and carry rows) -> (g at the drafting
    row, prev at the carry row, prev at the drafting row when recursive steps follow), in as few gathers as
    the module allows: one when it hands g on unchanged."""
    batch = rows.shape[1]
    if prev is g:
        both = g.reshape(batch * g.shape[1], -1).index_select(0, rows.view(-1))  # [2B, H]
        return both[:batch], both[batch:], both[:batch]
    flat, hidden = prev.reshape(-1, prev.shape[-1]), g.reshape(-1, g.shape[-1])
    last = flat.index_select(0, rows[0]) if recursive else None
    return hidden.index_select(0, rows[0]), flat.index_select(0, rows[1]), last


class DraftSampler:
    """Samples draft j of every row with the request's own transform (penalties see earlier drafts)."""

    def __init__(self, chain: UniformChain, slots: torch.Tensor, frontier: torch.Tensor, samp: SamplingTensors,
                 flags: SamplingFlags) -> None:
        self.chain, self.slots, self.frontier, self.samp, self.flags = chain, slots, frontier, samp, flags
        self.extra = None
        if flags.penalties:
            self.extra = torch.zeros(len(slots), chain.state.vocab, device=slots.device)
        # A plain greedy draft is the argmax of the head's own output: upcasting it first changes no value.
        self.needs_fp32 = not flags.all_greedy or flags.penalties

    def __call__(self, j: int, logits: torch.Tensor
                 ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor] | tuple[torch.Tensor, None, None]:
        """logits [B, V] -> (draft [B], top-M ids [B, M], top-M probs [B, M]); greedy: (draft [B], None, None)."""
        m = self.chain.top_m
        st = self.samp
        if self.extra is not None:
            counts, prompt_mask = self.chain.buffers.penalty_state(self.slots)
            logits = apply_penalties(logits, counts + self.extra, prompt_mask, st)
        if self.flags.all_greedy:  # greedy verification never reads the proposals
            argmax = argmax_rows(logits)
            if self.extra is not None:
                self.extra[torch.arange(len(argmax), device=argmax.device), argmax] += 1.0
            return argmax, None, None
        tokens, ids, probs = sample_draft(logits, st, m, self.frontier + j)
        if self.extra is not None:
            self.extra[torch.arange(len(tokens), device=tokens.device), tokens] += 1.0
        return tokens, _pad_m(ids, m), _pad_m(probs, m)

    def count(self, drafts: torch.Tensor) -> None:
        """Drafts [B, j] sampled elsewhere: later drafts' penalties see them, as if sampled here."""
        if self.extra is not None:
            self.extra.zero_()
            self.extra.scatter_add_(1, drafts, torch.ones_like(drafts, dtype=self.extra.dtype))


def _pad_m(x: torch.Tensor, m: int) -> torch.Tensor:
    """Small vocabularies give fewer than m entries: pad with zero-probability copies of entry 0."""
    if x.shape[1] == m:
        return x
    pad = x[:, :1].expand(-1, m - x.shape[1])
    return torch.cat((x, torch.zeros_like(pad) if x.is_floating_point() else pad), dim=1)
