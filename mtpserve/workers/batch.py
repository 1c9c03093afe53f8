"""Flat-batch attention metadata from per-request (start position, query length, block table)."""

from __future__ import annotations

import numpy as np
import torch

from mtpserve.workers.attention import AttentionMetadata
from mtpserve.workers.device import to_device


def build_metadata(
    starts: np.ndarray,  # [R] first position of each request's queries
    query_lens: np.ndarray,  # [R]
    tables: list[list[int]],  # [R] block ids of the KV group
    block_size: int,
    device: torch.device,
) -> tuple[torch.Tensor, AttentionMetadata]:
    """-> (positions [T], metadata). Requests' queries are contiguous and in the given order."""
    num_reqs = len(query_lens)
    qsl = np.zeros(num_reqs + 1, dtype=np.int64)
    np.cumsum(query_lens, out=qsl[1:])
    req_of_token = np.repeat(np.arange(num_reqs), query_lens)
    positions = np.arange(qsl[-1]) - qsl[:-1][req_of_token] + starts[req_of_token]
    seq_lens = starts + query_lens
    max_blocks = max((len(t) for t in tables), default=0) or 1
    block_table = np.zeros((num_reqs, max_blocks), dtype=np.int32)
    for i, table in enumerate(tables):
        block_table[i, : len(table)] = table
    slots = block_table[req_of_token, positions // block_size].astype(np.int64) * block_size + positions % block_size
    meta = AttentionMetadata(
        query_start_loc=to_device(qsl, torch.int32, device),
        seq_lens=to_device(seq_lens, torch.int32, device),
        block_tables=to_device(block_table, torch.int32, device),
        slot_mapping=to_device(slots, torch.int64, device),
        max_query_len=int(query_lens.max(initial=0)),
        max_seq_len=int(seq_lens.max(initial=0)),
    )
    return to_device(positions, torch.int64, device), meta
