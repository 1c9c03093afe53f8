"""Staging (mtpserve/workers/device.py): the per-step copies through reused pinned buffers."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from mtpserve.workers.device import Staging

needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="pinned buffers and events need a CUDA GPU")


def test_off_cuda_upload_wraps_and_download_returns_the_tensor() -> None:
    staging = Staging(torch.device("cpu"))
    up = staging.upload(np.array([3, 1, 2], dtype=np.int32))
    assert up.dtype == torch.int64 and up.tolist() == [3, 1, 2]
    t = torch.arange(4)
    host, done = staging.download(t)
    assert host is t and done is None


@needs_cuda
def test_uploads_and_downloads_round_trip_through_the_rings() -> None:
    staging = Staging(torch.device("cuda"))
    rng = np.random.default_rng(0)
    storages = set()
    for size in [64] * (2 * Staging.DEPTH) + [10_000]:  # every ring buffer reused, then one grown
        data = rng.integers(-2**40, 2**40, size=size)
        dev = staging.upload(data)
        doubled = dev * 2  # a kernel that reads the upload before the next one overwrites it
        host, done = staging.download(doubled)
        assert host.is_pinned()
        done.synchronize()
        assert host.tolist() == (data * 2).tolist()
        if size == 64:
            storages.add(host.untyped_storage().data_ptr())
    assert len(storages) == Staging.DEPTH  # no pinned allocation per step
    values = torch.linspace(-1, 1, 7, dtype=torch.float64, device="cuda").view(7, 1)
    host, done = staging.download(values)
    done.synchronize()
    assert host.dtype == torch.float64 and host.shape == (7, 1) and torch.equal(host, values.cpu())


@needs_cuda
def test_an_upload_is_read_by_earlier_kernels_before_the_next_overwrites_it() -> None:
    staging = Staging(torch.device("cuda"))
    outs = []
    for i in range(2 * Staging.DEPTH):
        dev = staging.upload(np.full(1024, i))
        torch.cuda._sleep(100_000)  # the reads below wait behind this while the host uploads again
        outs.append(dev.sum())
    assert [int(o) for o in outs] == [1024 * i for i in range(2 * Staging.DEPTH)]


@needs_cuda
def test_a_stamp_and_a_download_time_the_work_between_them_on_the_device() -> None:
    """What adaptive speculation takes for a step's device share (design §9): the GPU's time from the stamp
    to the copy's end, however early the host got there."""
    staging = Staging(torch.device("cuda"))
    for _ in range(Staging.DEPTH + 1):  # the stamps are a ring too
        begun = staging.stamp()
        torch.cuda._sleep(2_000_000)  # a few ms of device time the host does not wait for
        host, done = staging.download(torch.arange(8, device="cuda"))
        done.synchronize()
        seconds = begun.elapsed_time(done) / 1e3
        assert 1e-4 < seconds < 0.5, seconds
    assert Staging(torch.device("cpu")).stamp() is None
