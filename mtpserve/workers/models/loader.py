"""Load a Hugging Face-layout checkpoint (config.json + *.safetensors) into the target and MTP models.

Every tensor name and shape is checked against the architecture's map before a single byte is
copied, so a bad checkpoint fails with an error naming the tensor and nothing is half-loaded.
"""

from __future__ import annotations

import json
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Iterator

import torch
from safetensors import safe_open
from torch import nn

from mtpserve.errors import CheckpointError
from mtpserve.workers.models import fp8, fp8_linear
from mtpserve.workers.models.config import FP8Config, ModelConfig
from mtpserve.workers.models.decoder import TargetModel
from mtpserve.workers.models.mtp import MTPStack
from mtpserve.workers.models.weight_names import WeightSpec, mtp_specs, target_specs

Index = dict[str, tuple[str, tuple[int, ...], str]]  # tensor name -> (file, shape, dtype name)

# Tensors some exporters write that carry no weights we need.
_IGNORED_SUFFIXES = ("rotary_emb.inv_freq",)


@dataclass(frozen=True)
class ModelSource:
    """A checkpoint to load and how: the part of the engine's configuration a worker needs."""

    path: Path
    dtype: torch.dtype
    device: torch.device  # its type; a Ray worker picks its own index


@dataclass
class LoadedModel:
    config: ModelConfig
    target: TargetModel
    mtp: MTPStack


def load_model(path: str | Path, dtype: torch.dtype, device: torch.device | str,
               keep: Callable[[str], bool] | None = None, serve_fp8: bool | None = None) -> LoadedModel:
    """Load every tensor, or (with `keep`) only the parameters whose names it accepts ("embed_tokens.weight",
    "layers.0....", "mtp.1...."): the others stay on the meta device, so a drafter process can hold its MTP
    modules without the target's layers. The whole checkpoint is checked either way.

    `serve_fp8` (default: on CUDA devices) keeps a block-scaled FP8 checkpoint's weights in FP8
    (models/fp8_linear.py); otherwise they are dequantised to `dtype` as they load."""
    loader = CheckpointLoader(path, dtype, device, serve_fp8)
    loader.load(keep, device)
    return loader.model


class CheckpointLoader:
    """A checked checkpoint and its model built on the meta device, loaded a part at a time.

    Tensor parallelism loads this way: one layer on the host, shard it, move the shard to the device,
    next layer; so a rank never holds the whole model, on the device or on the host. `serve_fp8` as in
    load_model (default: on CUDA devices); the tensor-parallel pass slices FP8 linears by whole blocks.
    """

    def __init__(self, path: str | Path, dtype: torch.dtype, device: torch.device | str,
                 serve_fp8: bool | None = None) -> None:
        path = Path(path)
        if not path.is_dir():
            raise CheckpointError(f"checkpoint path {str(path)!r} is not a directory")
        cfg = ModelConfig.from_dir(path)
        self.path, self.index = path, _tensor_index(path)
        specs = target_specs(cfg) + mtp_specs(cfg)
        _check(cfg, specs, self.index)
        self.present = [s for s in specs if s.ckpt_name in self.index]
        self.fp8_params: set[str] = set()  # parameters kept in FP8
        serve_fp8 = torch.device(device).type == "cuda" if serve_fp8 is None else serve_fp8
        with torch.device("meta"), default_dtype(dtype):
            target = TargetModel(cfg)
            mtp = MTPStack(cfg, target.rotary)
            _add_module_copies(cfg, mtp, self.present)
            if serve_fp8 and cfg.fp8 is not None:
                scaled = {s.ckpt_name for s in self.present if fp8.scale_name(s.ckpt_name) in self.index}
                self.fp8_params = fp8_linear.servable(self.present, scaled, cfg.fp8.block)
                fp8_linear.swap_in(target, {p for p in self.fp8_params if not p.startswith("mtp.")}, cfg.fp8.block)
                fp8_linear.swap_in(mtp, {p for p in self.fp8_params if p.startswith("mtp.")}, cfg.fp8.block)
        target.rotary.to_empty(device=device)
        target.rotary.reset()
        self.model = LoadedModel(cfg, target.eval(), mtp.eval())

    def load(self, keep: Callable[[str], bool] | None, device: torch.device | str) -> None:
        """Give the parameters `keep` accepts (all when None) storage on `device` and copy them in."""
        cfg, target, mtp = self.model.config, self.model.target, self.model.mtp
        if keep is None:
            target.to_empty(device=device)
            mtp.to_empty(device=device)
            target.rotary.reset()
            specs = self.present
        else:
            _materialize({**_params(target, ""), **_params(mtp, "")}, target, mtp, keep, device)
            specs = [s for s in self.present if keep(s.param)]
        if cfg.tie_word_embeddings and (keep is None or keep("embed_tokens.weight")):
            target.lm_head.weight = target.embed_tokens.weight
        _copy_weights(self.path, self.index, specs, {**_params(target, ""), **_params(mtp, "")}, cfg.fp8,
                      self.fp8_params)


def _materialize(params: dict[str, torch.Tensor], target: nn.Module, mtp: nn.Module, keep: Callable[[str], bool],
                 device: torch.device | str) -> None:
    """Give the kept parameters storage on `device`; the rest stay on meta."""
    for name, p in params.items():
        if keep(name):
            owner_name, _, attr = name.rpartition(".")
            root = mtp if name.startswith("mtp.") else target
            owner = root.get_submodule(owner_name) if owner_name else root
            setattr(owner, attr, nn.Parameter(torch.empty_like(p, device=device), requires_grad=False))


def _tensor_index(path: Path) -> Index:
    """Tensor name -> (file, shape, safetensors dtype name), read from the headers without loading data."""
    index_file = path / "model.safetensors.index.json"
    if index_file.is_file():
        files = sorted(set(json.loads(index_file.read_text())["weight_map"].values()))
    else:
        files = sorted(p.name for p in path.glob("*.safetensors"))
    if not files:
        raise CheckpointError(f"no *.safetensors files in checkpoint directory {path}")
    index: Index = {}
    for name in files:
        if not (path / name).is_file():
            raise CheckpointError(f"model.safetensors.index.json names {name}, which is not in {path}")
        with safe_open(path / name, framework="pt") as f:
            for key in f.keys():
                tensor = f.get_slice(key)
                index[key] = (name, tuple(tensor.get_shape()), tensor.get_dtype())
    return index


def _check(cfg: ModelConfig, specs: list[WeightSpec], index: Index) -> None:
    scales, problems = fp8.check_scales(cfg.fp8, {s.ckpt_name: s.shape for s in specs}, index)
    expected = {s.ckpt_name for s in specs} | scales
    for spec in specs:
        if spec.ckpt_name not in index:
            if not spec.optional:
                problems.append(f"missing tensor {spec.ckpt_name} (expected shape {list(spec.shape)})")
        elif index[spec.ckpt_name][1] != spec.shape:
            actual = list(index[spec.ckpt_name][1])
            problems.append(f"tensor {spec.ckpt_name} has shape {actual}, expected {list(spec.shape)}")
    tied_head = {"lm_head.weight"} if cfg.tie_word_embeddings else set()
    for name in sorted(set(index) - expected - tied_head):
        if not name.endswith(_IGNORED_SUFFIXES):
            problems.append(f"unexpected tensor {name} with shape {list(index[name][1])}")
    if problems:
        more = f" (and {len(problems) - 5} more)" if len(problems) > 5 else ""
        raise CheckpointError(f"checkpoint does not match {cfg.architecture}: " + "; ".join(problems[:5]) + more)


def _add_module_copies(cfg: ModelConfig, mtp: MTPStack, present: list[WeightSpec]) -> None:
    names = {s.param for s in present}
    for k, module in enumerate(mtp.mtp):
        if f"mtp.{k}.embed_tokens.weight" in names:
            module.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        if f"mtp.{k}.head.weight" in names:
            module.head = nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False)


def _params(module: nn.Module, prefix: str) -> dict[str, torch.Tensor]:
    return {prefix + name: p for name, p in module.named_parameters(remove_duplicate=False)}


@torch.no_grad()
def _copy_weights(
    path: Path,
    index: Index,
    specs: list[WeightSpec],
    params: dict[str, torch.Tensor],
    fp8_cfg: FP8Config | None,
    fp8_params: set[str],
) -> None:
    by_file: dict[str, list[WeightSpec]] = {}
    for spec in specs:
        by_file.setdefault(index[spec.ckpt_name][0], []).append(spec)
    for name, file_specs in by_file.items():
        with safe_open(path / name, framework="pt") as f:
            for spec in file_specs:
                if spec.param in fp8_params:  # kept as FP8: the tensor and its scales as they are
                    assert fp8_cfg is not None
                    scale = _read(path, index, fp8.scale_name(spec.ckpt_name), name, f)
                    fp8_linear.copy_fp8(params[spec.param], params[spec.param + fp8.SCALE_SUFFIX], spec,
                                        f.get_tensor(spec.ckpt_name), scale, fp8_cfg.block)
                    continue
                dst = params[spec.param]
                if spec.index is not None:
                    dst = dst[spec.index]
                if spec.row_offset is not None:
                    dst = dst.narrow(0, spec.row_offset, spec.shape[0])
                tensor = f.get_tensor(spec.ckpt_name)
                scale = fp8.scale_name(spec.ckpt_name)
                if fp8_cfg is not None and scale in index:
                    tensor = fp8.dequantize(tensor, _read(path, index, scale, name, f), fp8_cfg)
                dst.copy_(tensor)


def _read(path: Path, index: Index, tensor: str, open_name: str, open_file: Any) -> torch.Tensor:
    """One tensor, from the file already open when it lives there (sharded checkpoints may split a
    weight and its scale across files)."""
    file = index[tensor][0]
    if file == open_name:
        return open_file.get_tensor(tensor)
    with safe_open(path / file, framework="pt") as f:
        return f.get_tensor(tensor)


@contextmanager
def default_dtype(dtype: torch.dtype) -> Iterator[None]:
    old = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        yield
    finally:
        torch.set_default_dtype(old)
