"""mtp_input: the fused MTP input against the unfused kernels it replaces and the torch reference.

Bit for bit against the unfused path the models take on CUDA (embedding, mask, shift and cat in torch,
both norms through the Triton rms_norm): the fused kernel rounds as that kernel does. Against
mtp_input_ref to the RMSNorm tests' tolerance: the norm's fp32 sum runs in another order, and the
interpreter truncates fp32 -> bf16 where torch rounds. Token ids are a column slice of a wider window
and the hidden rows a slice of a wider buffer, as uniform_chain.py passes them. Interpreted on CPU,
compiled on CUDA where a GPU exists (see conftest.py).
"""

from __future__ import annotations

import pytest
import torch

from mtpserve.kernels.mtp_input_ref import mtp_input_ref, mtp_input_rows
from mtpserve.kernels.rmsnorm_ref import rms_norm_ref

VOCAB, EPS = 40, 1e-6
TOLERANCE = {torch.float32: 1e-6, torch.bfloat16: 2e-2}  # as test_norm_activation.py

# name: (batch, q, hidden, shifted, mask_position0, hidden_first): every pair of values of any two knobs
CASES = {
    "window-shifted-masked": (3, 4, 96, True, True, False),
    "window-hidden-first": (3, 4, 64, False, False, True),
    "one-request-window": (1, 4, 96, False, True, True),
    "one-request-shifted": (1, 4, 64, True, False, False),
    "decode-rows": (3, 1, 96, False, False, False),
    "decode-shifted": (3, 1, 64, True, True, True),
    "one-row-shifted": (1, 1, 96, True, False, True),
}


def _case(batch: int, q: int, hidden: int, shifted: bool, dtype: torch.dtype, device: torch.device, seed: int
          ) -> tuple[torch.Tensor, ...]:
    """(token_ids, positions, embed, prev_hidden, first_hidden or None, enorm_weight, hnorm_weight) on device.
    Request 0 starts at position 0 (the row the mask zeroes), the others further on."""
    gen = torch.Generator().manual_seed(seed)
    window = torch.randint(0, VOCAB, (batch, q + 3), generator=gen).to(device)  # [B, W]
    positions = (torch.tensor([0, 9, 2])[:batch, None] + torch.arange(q)).reshape(-1).to(device)
    embed = (torch.randn(VOCAB, hidden, generator=gen) * 3).to(dtype).to(device)
    rows = q + 1 - shifted  # one row more than the module reads
    wide = (torch.randn(batch, rows + 2, hidden + 8, generator=gen) * 2).to(dtype).to(device)  # [B, P + 2, H + 8]
    carry = torch.randn(batch, 3, hidden, generator=gen).to(dtype).to(device)  # [B, modules, H]
    enorm_w, hnorm_w = ((1.0 + 0.5 * torch.randn(hidden, generator=gen)).to(dtype).to(device) for _ in range(2))
    return (window[:, :q], positions, embed, wide[:, 1 : rows + 1, :hidden], carry[:, 1] if shifted else None,
            enorm_w, hnorm_w)


def _unfused(token_ids: torch.Tensor, positions: torch.Tensor, embed: torch.Tensor, prev_hidden: torch.Tensor,
             first_hidden: torch.Tensor | None, enorm_w: torch.Tensor, hnorm_w: torch.Tensor, mask_position0: bool,
             hidden_first: bool) -> torch.Tensor:
    """The path MTPStack.forward takes without the fused kernel: torch glue around two Triton rms_norms."""
    from mtpserve.kernels.rmsnorm import rms_norm

    emb, hidden = mtp_input_rows(token_ids, positions, embed, prev_hidden, first_hidden, mask_position0)
    e, h = rms_norm(emb, enorm_w, EPS), rms_norm(hidden, hnorm_w, EPS)
    return torch.cat((h, e) if hidden_first else (e, h), dim=-1)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("case", list(CASES))
def test_kernel_matches_the_unfused_path_and_the_reference(kernels, case, dtype):
    from mtpserve.kernels.mtp_input import mtp_input

    batch, q, hidden, shifted, mask0, hidden_first = CASES[case]
    args = _case(batch, q, hidden, shifted, dtype, kernels.device, seed=list(CASES).index(case))
    got = mtp_input(*args, EPS, mask0, hidden_first)
    assert got.shape == (batch * q, 2 * hidden) and got.dtype == dtype and got.is_contiguous()
    assert torch.equal(got, _unfused(*args, mask0, hidden_first))
    want = mtp_input_ref(*(a.cpu() if a is not None else None for a in args), EPS, mask0, hidden_first)
    tol = TOLERANCE[dtype]
    torch.testing.assert_close(got.cpu(), want, atol=tol, rtol=tol)
    e_half = got.cpu()[:, hidden:] if hidden_first else got.cpu()[:, :hidden]
    masked = (args[1].cpu() == 0) if mask0 else torch.zeros(batch * q, dtype=torch.bool)
    assert masked.any() == mask0 and not e_half[masked].any() and e_half[~masked].any(dim=1).all()


def test_kernel_with_fp32_weights_on_bf16_rows_returns_fp32(kernels):
    """The weights' dtype decides the output's as for rms_norm: promoted, each half weighted in fp32."""
    from mtpserve.kernels.mtp_input import mtp_input

    ids, pos, embed, prev, first, enorm_w, hnorm_w = _case(3, 4, 96, True, torch.bfloat16, kernels.device, seed=11)
    args = (ids, pos, embed, prev, first, enorm_w.float(), hnorm_w.float())
    got = mtp_input(*args, EPS, True, False)
    assert got.dtype == torch.float32 and torch.equal(got, _unfused(*args, True, False))


@pytest.mark.parametrize("shifted", [False, True], ids=["aligned", "shifted"])
def test_reference_matches_a_loop_over_rows(shifted):
    batch, q, hidden = 2, 3, 16
    args = _case(batch, q, hidden, shifted, torch.float32, torch.device("cpu"), seed=5)
    ids, pos, embed, prev, first, enorm_w, hnorm_w = args
    got = mtp_input_ref(*args, EPS, True, True)
    for b in range(batch):
        for i in range(q):
            h_row = first[b] if shifted and i == 0 else prev[b, i - shifted]
            e_row = embed[ids[b, i]] * (pos[b * q + i] != 0)
            want = torch.cat((rms_norm_ref(h_row, hnorm_w, EPS), rms_norm_ref(e_row, enorm_w, EPS)))
            assert torch.equal(got[b * q + i], want)


def test_kernel_takes_an_empty_batch_and_rejects_mismatched_inputs(kernels):
    from mtpserve.kernels.mtp_input import mtp_input

    ids, pos, embed, prev, first, enorm_w, hnorm_w = _case(3, 4, 64, True, torch.float32, kernels.device, seed=3)
    assert mtp_input(ids[:0], pos[:0], embed, prev[:0], first[:0], enorm_w, hnorm_w, EPS, True, False).shape == (0, 128)
    bad = {
        "token_ids": dict(token_ids=ids.reshape(-1)),
        "positions": dict(positions=pos[:-1]),
        "prev_hidden": dict(prev_hidden=prev[:, :2]),  # shifted: 4 rows need 3
        "first_hidden": dict(first_hidden=first[:2]),
        "enorm_weight": dict(enorm_weight=enorm_w[:32]),
        "hnorm_weight": dict(hnorm_weight=hnorm_w.double()),
    }
    good = dict(token_ids=ids, positions=pos, embed=embed, prev_hidden=prev, first_hidden=first,
                enorm_weight=enorm_w, hnorm_weight=hnorm_w, eps=EPS, mask_position0=True, hidden_first=False)
    for name, change in bad.items():
        with pytest.raises(ValueError, match=name):
            mtp_input(**{**good, **change})
    with pytest.raises(ValueError, match="prev_hidden"):  # unshifted, 3 rows cannot feed 4
        mtp_input(**{**good, "prev_hidden": prev[:, :3], "first_hidden": None})
