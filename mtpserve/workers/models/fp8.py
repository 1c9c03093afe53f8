"""Block-scaled FP8 checkpoints (DeepSeek-V3 style): checks before loading and dequantisation.

A quantised tensor `X.weight` [rows, cols] is float8_e4m3fn and comes with `X.weight_scale_inv`
[ceil(rows / br), ceil(cols / bc)] (fp32): weight[i, j] = fp8[i, j] * scale_inv[i // br, j // bc].
Which tensors are quantised is read from the checkpoint (a tensor with a scale is), so a target in FP8
beside MTP modules in BF16 loads as it is. On CUDA the quantised weights stay FP8 with their scales
(fp8_linear.py: Triton block-scaled GEMMs); on a CPU they are dequantised to the compute dtype as they
load.
"""

from __future__ import annotations

import math

import torch

from mtpserve.kernels.fp8_gemm_ref import dequantize_block_fp8
from mtpserve.workers.models.config import FP8Config

SCALE_SUFFIX = "_scale_inv"
FP8_DTYPE_NAME = "F8_E4M3"  # safetensors' name of torch.float8_e4m3fn


def scale_name(weight_name: str) -> str:
    return weight_name + SCALE_SUFFIX


def scale_shape(weight_shape: tuple[int, ...], fp8: FP8Config) -> tuple[int, int]:
    rows, cols = weight_shape
    return math.ceil(rows / fp8.block[0]), math.ceil(cols / fp8.block[1])


def check_scales(fp8: FP8Config | None, weights: dict[str, tuple[int, ...]],
                 index: dict[str, tuple[str, tuple[int, ...], str]]) -> tuple[set[str], list[str]]:
    """-> (the scale tensors the checkpoint rightly carries, problems). `weights`: name -> expected shape."""
    if fp8 is None:
        unscaled = sorted(name for name in weights if name in index and index[name][2] == FP8_DTYPE_NAME)
        return set(), [f"tensor {name} is FP8 but config.json has no quantization_config" for name in unscaled]
    scales, problems = set(), []
    for name, shape in weights.items():
        scale = scale_name(name)
        if name not in index:
            continue
        dtype = index[name][2]
        if scale not in index:
            if dtype == FP8_DTYPE_NAME:
                problems.append(f"tensor {name} is FP8 but has no {scale}")
            continue
        scales.add(scale)
        if len(shape) != 2:
            problems.append(f"tensor {scale} scales {name}, which is not a matrix")
        elif index[scale][1] != scale_shape(shape, fp8):
            problems.append(f"tensor {scale} has shape {list(index[scale][1])}, expected "
                            f"{list(scale_shape(shape, fp8))} for blocks of {list(fp8.block)}")
        elif dtype != FP8_DTYPE_NAME:
            problems.append(f"tensor {name} has a scale but dtype {dtype}, expected float8_e4m3fn")
    return scales, problems


def dequantize(weight: torch.Tensor, scale_inv: torch.Tensor, fp8: FP8Config) -> torch.Tensor:
    """fp8 [rows, cols] and per-block scales -> fp32 [rows, cols] (each element's product, exact)."""
    return dequantize_block_fp8(weight, scale_inv, fp8.block)
