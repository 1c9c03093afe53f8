"""An FP8-served tiny GLM-4.5 / DeepSeek-V3 model with its FP8 products through the Triton kernels
(fp8_linear for every FP8Linear, grouped_gemm_fp8 for the experts; interpreted on CPU, compiled on
CUDA, see conftest.py) against the same checkpoint dequantised, both in fp32: equal up to the order
of fp32 accumulation. Also the tile choice of FP8Linear's kernel call."""

from __future__ import annotations

import pytest
import torch

from mtpserve.workers.models import fp8_linear
from mtpserve.workers.models.loader import load_model
from tests.workers.test_fp8 import quantized_pair
from tests.workers.test_fp8_serving import fp8_source, logits_of


@pytest.mark.parametrize("family", ["glm4_moe", "deepseek_v3"])
def test_fp8_model_through_the_kernels_equals_the_dequantised_model(kernels, family, tmp_path, monkeypatch):
    fp8_dir, deq_dir = quantized_pair(fp8_source(tmp_path / "src", family), tmp_path, (16, 16))
    if kernels.device.type == "cpu":  # the kernels, interpreted, in place of the torch path
        monkeypatch.setattr(fp8_linear, "_kernels", lambda x: True)
    ours = load_model(fp8_dir, torch.float32, kernels.device, serve_fp8=True)
    twin = load_model(deq_dir, torch.float32, kernels.device)
    assert ours.target.layers[2].mlp.experts.down_proj.dtype == torch.float8_e4m3fn
    for out, expected in zip(logits_of(ours), logits_of(twin)):
        torch.testing.assert_close(out, expected, rtol=1e-4, atol=1e-4 * expected.abs().max().item())


def test_tiles_fill_the_sms_before_widening():
    assert fp8_linear.tiles(1, 4096, 132) == (16, 16)  # 256 programs: 64-wide tiles would leave SMs idle
    assert fp8_linear.tiles(64, 4096, 132) == (64, 16)  # one row tile: as narrow as tl.dot allows
    assert fp8_linear.tiles(40, 12288, 132) == (64, 32)  # 384 programs at 32 wide
    assert fp8_linear.tiles(4096, 4096, 132) == (64, 64)  # prefill: plenty of programs
    assert fp8_linear.tiles(20, 57344, 132) == (32, 64)
