"""The parts of a step that step_benchmark.py times apart from the whole: one draft position, and a verify window
without its chain (issue 12's second and third targets, each against its own floor)."""

from __future__ import annotations

import argparse
from typing import Any

import torch

import common


def draft_position_ms(driver: Any, batch: int, device: torch.device, args: argparse.Namespace
                      ) -> tuple[float, float]:
    """(serial, overlapped) ms of one draft position: steps that verify a draft and draft one, less steps of
    the same verify window that draft none (a step that drafts pads its window to its chain)."""
    ms = {}
    for chain in (0, 1):
        driver.prefill(batch, 1, args.context, args.prefill_tokens)
        serial = common.median(common.time_ms(lambda: driver.verify_step(1, chain), device, args.warmup, args.iters))
        ms[chain] = serial, driver.overlapped_ms(1, device, args.warmup, args.iters, chain)
    return ms[1][0] - ms[0][0], ms[1][1] - ms[0][1]


def verify_window_ms(driver: Any, batch: int, k: int, device: torch.device, args: argparse.Namespace
                     ) -> tuple[float, float]:
    """(serial, overlapped) ms of a verify window of k + 1 tokens per request that drafts none (chain 0): the target
    over the window's rows, its attention, the LM head and the verification, without the MTP chain whose draft
    positions the draft table prices. Its floor is a k = 0 step's over the window's KV."""
    driver.prefill(batch, k, args.context, args.prefill_tokens)
    serial = common.median(common.time_ms(lambda: driver.verify_step(k, 0), device, args.warmup, args.iters))
    return serial, driver.overlapped_ms(k, device, args.warmup, args.iters, 0)
