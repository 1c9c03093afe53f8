"""Shared fixtures: tiny checkpoints in Hugging Face layout, built by the tests themselves."""

from __future__ import annotations

import faulthandler
import gc
import os
import sys
import threading
from pathlib import Path
from typing import Iterator

import pytest
import torch

from mtpserve.workers.models.train import synthetic_tokens, tiny_config, train_tiny
from mtpserve.workers.models.writer import save_checkpoint

# GPU runs measure their GEMM choices afresh and leave no cache in the home directory (linear_dispatch.py).
os.environ.setdefault("MTPSERVE_SKINNY_CACHE", "")


def _trained(path: Path, steps: int) -> Path:
    """A tiny Qwen3 target with 3 DeepSeek-style MTP modules, trained on a noisy Markov stream."""
    cfg = tiny_config(vocab_size=64, num_mtp=3)
    target, mtp = train_tiny(synthetic_tokens(64, 20_000, seed=1, noise=0.3), cfg, steps=steps, seed=0,
                             seq_len=32, batch_size=16, lr=1e-2)
    save_checkpoint(path, cfg, target, mtp, dtype=torch.float32)
    return path


@pytest.fixture(scope="session")
def trained_ckpt(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Trained until its MTP modules predict well: speculation accepts most drafts."""
    return _trained(tmp_path_factory.mktemp("trained"), steps=40)


@pytest.fixture(scope="session")
def partly_trained(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Trained so briefly that the MTP modules are right about a third of the time: drafts are
    accepted and rejected in every pattern, which is what equivalence and replay must survive."""
    return _trained(tmp_path_factory.mktemp("partly_trained"), steps=8)


@pytest.fixture(autouse=True)
def _unfreeze_the_heap() -> Iterator[None]:
    """An engine freezes the heap it started with (mtpserve/workers/heap.py): right for a process that
    serves one engine, a leak for a test session that builds hundreds. Each test's engines become
    collectable again once it ends."""
    yield
    gc.unfreeze()


def prompts_of(vocab: int, lengths: list[int], seed: int = 0) -> list[list[int]]:
    gen = torch.Generator().manual_seed(seed)
    return [torch.randint(1, vocab, (n,), generator=gen).tolist() for n in lengths]


def pytest_sessionfinish(session: pytest.Session, exitstatus: int) -> None:
    """Name the threads still running when the tests are done: each one outlives its test's teardown
    and runs into the interpreter's finalisation, where a thread inside torch, gRPC or Ray can crash
    the process after every test passed."""
    left = sorted(f"{t.name} (daemon={t.daemon})" for t in threading.enumerate()
                  if t is not threading.main_thread() and t.is_alive())
    print(f"\nthreads alive after the tests: {left}", file=sys.stderr)


def pytest_unconfigure(config: pytest.Config) -> None:
    # pytest's own faulthandler is off again by now: keep one on, so that a crash while the process
    # shuts down prints every thread's stack instead of a bare exit code 139.
    faulthandler.enable(file=sys.__stderr__, all_threads=True)
