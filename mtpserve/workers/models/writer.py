"""Write our models back out in Hugging Face layout (used by training and by tests' tiny checkpoints)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import save_file

from mtpserve.workers.models.config import ModelConfig
from mtpserve.workers.models.decoder import TargetModel
from mtpserve.workers.models.mtp import MTPStack
from mtpserve.workers.models.weight_names import mtp_specs, target_specs


def save_checkpoint(
    path: str | Path,
    hf_config: dict[str, Any],
    target: TargetModel,
    mtp: MTPStack,
    dtype: torch.dtype = torch.bfloat16,
) -> None:
    """Write config.json and model.safetensors; the inverse of loader.load_model for the same config."""
    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    cfg = ModelConfig.from_dict(hf_config)
    params = {n: p for n, p in target.named_parameters()} | {n: p for n, p in mtp.named_parameters()}
    tensors: dict[str, torch.Tensor] = {}
    for spec in target_specs(cfg) + mtp_specs(cfg):
        if spec.param not in params:
            continue  # an optional per-module copy this model does not have
        src = params[spec.param].detach()
        if spec.row_offset is not None:
            src = src.narrow(0, spec.row_offset, spec.shape[0])
        tensors[spec.ckpt_name] = src.to(dtype).contiguous().cpu()
    save_file(tensors, str(path / "model.safetensors"), metadata={"format": "pt"})
    (path / "config.json").write_text(json.dumps(hf_config, indent=2) + "\n")
