"""StateDiffs.pack and DeviceState.apply on the CPU: what a step's one copy carries, and that the state ends
as if every change had been written in order (the last write to an index wins)."""

from __future__ import annotations

import numpy as np
import torch

from mtpserve.workers.slot_state import SEED, SEQ_LEN, TEMPERATURE, device_state


def test_pack_then_apply_leaves_the_last_write_of_each_field() -> None:
    state, diffs = device_state(num_slots=4, num_groups=2, max_len=64, block_size=16, vocab=100,
                                device=torch.device("cpu"))
    diffs.table(1, 2, [7, 8], 0)
    diffs.int_field(SEQ_LEN, 3, 5)
    diffs.int_field(SEED, 3, 2**62 + 1)
    diffs.int_field(SEQ_LEN, 3, 6)  # written twice in one step: the later value counts
    diffs.float_field(TEMPERATURE, 0, 0.25)
    head = np.array([3, 0], dtype=np.int64)
    host, counts = diffs.pack(head)
    assert counts == (2, 1, 2, 1) and host[:2].tolist() == [3, 0] and len(host) == 2 + 2 * sum(counts)
    state.apply(torch.from_numpy(host[2:]), counts)
    assert state.tables[1, 2, :3].tolist() == [7, 8, 0] and state.capacity[1, 2] == 32
    assert state.ints[SEQ_LEN, 3] == 6 and state.ints[SEED, 3] == 2**62 + 1
    assert state.floats[TEMPERATURE, 0] == 0.25
    assert diffs.pack(head)[1] == (0, 0, 0, 0)  # packing cleared them


def test_a_step_without_changes_carries_only_its_head() -> None:
    state, diffs = device_state(num_slots=2, num_groups=1, max_len=32, block_size=16, vocab=10,
                                device=torch.device("cpu"))
    before = [t.clone() for t in (state.tables, state.capacity, state.ints, state.floats)]
    host, counts = diffs.pack(np.array([1], dtype=np.int64))
    assert host.tolist() == [1] and counts == (0, 0, 0, 0)
    state.apply(torch.from_numpy(host[1:]), counts)
    assert all(torch.equal(a, b) for a, b in zip(before, (state.tables, state.capacity, state.ints, state.floats)))
