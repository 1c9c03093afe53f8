"""Block-scaled FP8 weights served as FP8 (on CUDA): a linear layer and an MoE expert stack that keep
the checkpoint's float8_e4m3fn weights and per-block scales and multiply through Triton kernels.

Weight-only FP8: activations stay in the model dtype. Each weight tile is dequantised in registers
and rounded to the activation dtype, exactly as a model dequantised at load would hold it, so the
result equals that model's up to the order of the fp32 accumulation, and decode (bound by the bytes
of the weights it reads) reads half the bytes of bf16. Per-token-group FP8 activations (what
DeepSeek trained with) would let the tensor cores run FP8 x FP8, which pays for prefill-sized
batches only; not done.

On a CPU the same modules fall back to the plain-torch references (dequantise per call): the loader
dequantises once at load there instead, and these modules run on a CPU only in tests.

Which parameters are served as FP8 is decided per parameter from the checkpoint (`servable`): every
tensor filling it is FP8 with a scale, and the fused parameters (q|k|v, gate|up) start each segment
on a block boundary, so one scale grid covers the whole fused matrix. MLA's kv_b_proj is always
dequantised: the absorbed attention reads its matrix per head (mla.py).

Tensor parallelism (workers/tensor_parallel.py) slices FP8 linears with `fp8_rows` / `fp8_cols`: a
rank's slice stays FP8 when it is made of whole quantisation blocks (the scales slice with it), and
is dequantised (`dequantized`) otherwise, e.g. GLM-4.5-Air's 1408-wide shared expert over two ranks.
"""

from __future__ import annotations

import math
from functools import lru_cache

import torch
import torch.nn.functional as F
from torch import nn

from mtpserve.kernels.fp8_gemm_ref import dequantize_block_fp8
from mtpserve.kernels.grouped_gemm_fp8_ref import grouped_gemm_fp8_ref
from mtpserve.workers.models.config import MoEConfig
from mtpserve.workers.models.fp8 import SCALE_SUFFIX
from mtpserve.workers.models.moe import Experts
from mtpserve.workers.models.weight_names import WeightSpec

_DEQUANTISED = ("kv_b_proj.weight",)


def _scale_param(rows: int, cols: int, block: tuple[int, int], experts: int | None = None) -> nn.Parameter:
    shape = (math.ceil(rows / block[0]), math.ceil(cols / block[1]))
    return nn.Parameter(torch.empty((experts, *shape) if experts else shape, dtype=torch.float32), requires_grad=False)


def _fp8_param(*shape: int) -> nn.Parameter:
    return nn.Parameter(torch.empty(shape, dtype=torch.float8_e4m3fn), requires_grad=False)


def _kernels(x: torch.Tensor) -> bool:
    """Whether x goes through the Triton kernels: on CUDA, also with MTPSERVE_FUSED_KERNELS=0 (as
    Experts' grouped GEMM), since the references dequantise every call. Tests patch it to run the
    kernels interpreted on a CPU."""
    return x.is_cuda


class FP8Linear(nn.Module):
    """y = x @ (weight * scale_inv per block)^T + bias; weight [out, in] fp8, scale_inv [ceil(out/BM), ceil(in/BK)]."""

    def __init__(self, in_features: int, out_features: int, bias: bool, block: tuple[int, int]) -> None:
        super().__init__()
        self.in_features, self.out_features, self.block = in_features, out_features, block
        self.compute_dtype = torch.get_default_dtype()  # the model's (built under the loader's default dtype)
        self.weight = _fp8_param(out_features, in_features)
        self.weight_scale_inv = _scale_param(out_features, in_features, block)
        self.bias = nn.Parameter(torch.empty(out_features), requires_grad=False) if bias else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        flat = x.reshape(-1, self.in_features)  # [T, in]
        if _kernels(x):
            y = fp8_matmul(flat.contiguous(), self.weight, self.weight_scale_inv, self.block)
            y = y if self.bias is None else y + self.bias
        else:  # the dequantised model's own arithmetic (bias inside F.linear), so CPU results are equal
            y = F.linear(flat, dequantize_block_fp8(self.weight, self.weight_scale_inv, self.block).to(x.dtype), self.bias)
        return y.view(*x.shape[:-1], self.out_features)


class FP8Experts(Experts):
    """Experts whose stacked gate|up [E, 2I, H] and down [E, H, I] weights are FP8 with per-expert block scales."""

    def __init__(self, hidden: int, moe: MoEConfig, block: tuple[int, int]) -> None:
        nn.Module.__init__(self)
        e, inter = moe.num_experts, moe.intermediate_size
        self.moe, self.block = moe, block
        self.gate_up_proj = _fp8_param(e, 2 * inter, hidden)
        self.gate_up_proj_scale_inv = _scale_param(2 * inter, hidden, block, e)
        self.down_proj = _fp8_param(e, hidden, inter)
        self.down_proj_scale_inv = _scale_param(hidden, inter, block, e)

    def matmul(self, rows: torch.Tensor, name: str, offsets: torch.Tensor) -> torch.Tensor:
        weight, scale = getattr(self, name), getattr(self, name + SCALE_SUFFIX)
        if _kernels(rows):
            from mtpserve.kernels.grouped_gemm import grouped_gemm_fp8

            return grouped_gemm_fp8(rows, weight, scale, offsets, self.block)
        return grouped_gemm_fp8_ref(rows, weight, scale, offsets, self.block)


@lru_cache(maxsize=None)
def _num_sms(index: int) -> int:
    return torch.cuda.get_device_properties(index).multi_processor_count


def tiles(n: int, m: int, sms: int) -> tuple[int, int]:
    """(block_n, block_m) of fp8_linear for n rows, m outputs: rows tiled no wider than needed, and
    output tiles narrowed until about two programs per SM read the weight (a decode GEMM of 64-wide
    tiles over 4096 outputs would leave half an H100 idle)."""
    block_n = 16 if n <= 16 else 32 if n <= 32 else 64
    block_m = 64
    while block_m > 16 and math.ceil(n / block_n) * math.ceil(m / block_m) < 2 * sms:
        block_m //= 2
    return block_n, block_m


def fp8_matmul(x: torch.Tensor, weight: torch.Tensor, scale_inv: torch.Tensor, block: tuple[int, int]) -> torch.Tensor:
    """x [N, K] @ dequantised(weight [M, K])^T -> [N, M] through the Triton kernel, tiles picked by shape."""
    from mtpserve.kernels.fp8_gemm import fp8_linear

    sms = _num_sms(x.device.index or 0) if x.is_cuda else 132
    block_n, block_m = tiles(x.shape[0], weight.shape[0], sms)
    return fp8_linear(x, weight, scale_inv, block, block_n=block_n, block_m=block_m)


def servable(specs: list[WeightSpec], scaled: set[str], block: tuple[int, int]) -> set[str]:
    """Our parameters to keep as FP8: linear weights and stacked expert weights whose every checkpoint
    tensor is in `scaled` (has a scale) and whose fused segments start on block boundaries."""
    by_param: dict[str, list[WeightSpec]] = {}
    for spec in specs:
        by_param.setdefault(spec.param, []).append(spec)
    ok = set()
    for param, parts in by_param.items():
        linear = param.endswith(".weight") and param.rpartition(".")[0].rpartition(".")[2].endswith("_proj")
        stacked = param.endswith(("mlp.experts.gate_up_proj", "mlp.experts.down_proj"))
        if not (linear or stacked) or param.endswith(_DEQUANTISED):
            continue
        if all(p.ckpt_name in scaled and (p.row_offset or 0) % block[0] == 0 for p in parts):
            ok.add(param)
    # An expert stack is served as FP8 only with both its matrices.
    for prefix in {p.rpartition(".")[0] for p in ok if not p.endswith(".weight")}:
        pair = {f"{prefix}.gate_up_proj", f"{prefix}.down_proj"}
        if not pair <= ok:
            ok -= pair
    return ok


def swap_in(root: nn.Module, params: set[str], block: tuple[int, int], prefix: str = "") -> None:
    """Replace the modules owning `params` (names as root.named_parameters() gives them, after `prefix`)
    with FP8Linear / FP8Experts of the same shape, on root's device (meta, when built for loading)."""
    for name in sorted(params):
        if not name.startswith(prefix):
            continue
        owner_name, _, attr = name[len(prefix):].rpartition(".")
        owner = root.get_submodule(owner_name)
        if isinstance(owner, nn.Linear) and attr == "weight":
            parent_name, _, child = owner_name.rpartition(".")
            with torch.device(owner.weight.device):
                new = FP8Linear(owner.in_features, owner.out_features, owner.bias is not None, block)
            setattr(root.get_submodule(parent_name) if parent_name else root, child, new)
        elif isinstance(owner, Experts) and not isinstance(owner, FP8Experts):
            hidden, moe = owner.gate_up_proj.shape[2], owner.moe
            parent_name, _, child = owner_name.rpartition(".")
            with torch.device(owner.gate_up_proj.device):
                new = FP8Experts(hidden, moe, block)
            setattr(root.get_submodule(parent_name), child, new)


def _whole_blocks(index: torch.Tensor, size: int, block: int) -> torch.Tensor | None:
    """The quantisation blocks that `index` (positions along a dimension of `size`) covers, in order, when
    it is made of whole blocks, the last one possibly the dimension's short end; None otherwise."""
    index = index.cpu()
    blocks = torch.unique_consecutive(index // block)
    whole = [torch.arange(b * block, min((b + 1) * block, size)) for b in blocks.tolist()]
    return blocks if whole and torch.equal(torch.cat(whole), index) else None


def _frozen(t: torch.Tensor) -> nn.Parameter:
    return nn.Parameter(t.detach().clone().contiguous(), requires_grad=False)


def _slice(linear: FP8Linear, dim: int, index: torch.Tensor, bias: torch.Tensor | None) -> FP8Linear | None:
    """linear's weight and scales restricted to `index` along `dim` (0: outputs, 1: inputs), or None
    unless `index` is whole quantisation blocks."""
    blocks = _whole_blocks(index, linear.weight.shape[dim], linear.block[dim])
    if blocks is None:
        return None
    weight = linear.weight.index_select(dim, index.to(linear.weight.device))
    with torch.device("meta"):
        out = FP8Linear(weight.shape[1], weight.shape[0], bias is not None, linear.block)
    out.compute_dtype, out.weight = linear.compute_dtype, _frozen(weight)
    out.weight_scale_inv = _frozen(linear.weight_scale_inv.index_select(dim, blocks.to(linear.weight.device)))
    out.bias = None if bias is None else _frozen(bias)
    return out


@torch.no_grad()
def fp8_rows(linear: FP8Linear, rows: torch.Tensor) -> FP8Linear | None:
    """Outputs `rows` of linear (bias included) as an FP8Linear, or None unless they are whole blocks."""
    bias = None if linear.bias is None else linear.bias[rows.to(linear.bias.device)]
    return _slice(linear, 0, rows, bias)


@torch.no_grad()
def fp8_cols(linear: FP8Linear, cols: torch.Tensor) -> FP8Linear | None:
    """x[:, cols] -> x @ W[:, cols]^T (no bias: a partial sum) as an FP8Linear, or None unless cols are whole blocks."""
    return _slice(linear, 1, cols, None)


@torch.no_grad()
def dequantized(linear: FP8Linear) -> nn.Linear:
    """The plain linear of linear's values in its compute dtype (what a dequantising load gives)."""
    with torch.device("meta"):
        out = nn.Linear(linear.in_features, linear.out_features, bias=linear.bias is not None)
    weight = dequantize_block_fp8(linear.weight, linear.weight_scale_inv, linear.block)
    out.weight = _frozen(weight.to(linear.compute_dtype))
    if linear.bias is not None:
        out.bias = _frozen(linear.bias)
    return out


@torch.no_grad()
def copy_fp8(weight: torch.Tensor, scale: torch.Tensor, spec: WeightSpec, fp8: torch.Tensor, scale_inv: torch.Tensor,
             block: tuple[int, int]) -> None:
    """Copy one checkpoint tensor and its scales, as they are, into its place in an FP8 parameter."""
    if spec.index is not None:
        weight, scale = weight[spec.index], scale[spec.index]
    if spec.row_offset is not None:
        weight = weight.narrow(0, spec.row_offset, spec.shape[0])
        scale = scale.narrow(0, spec.row_offset // block[0], math.ceil(spec.shape[0] / block[0]))
    weight.copy_(fp8)
    scale.copy_(scale_inv)
