"""The `models` and `case` fixtures of an MoE family's test module (test_glm4_moe.py, test_deepseek_v3.py).

Each config's checkpoint is written and loaded once per session and shared by both fixtures, which the
shared tests of test_models.py and test_mtp.py take.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Callable

import pytest
import torch

from mtpserve.workers.models.loader import LoadedModel, load_model
from tests.checkpoints import load_hf_model
from tests.moe_checkpoints import make_moe_checkpoint
from tests.moe_reference import MoEReference
from tests.reference import DEEPSEEK
from tests.workers.test_mtp import Case

_BUILT: dict[tuple[str, str], tuple[Path, LoadedModel]] = {}


def build_moe(family: str, configs: dict[str, dict[str, Any]], num_mtp: int, name: str,
              tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, LoadedModel]:
    """Config `name`'s checkpoint and our fp32 load of it, made once per session."""
    if (family, name) not in _BUILT:
        path = make_moe_checkpoint(tmp_path_factory.mktemp(name), family, num_mtp=num_mtp, **configs[name])
        _BUILT[(family, name)] = (path, load_model(path, torch.float32, "cpu"))
    return _BUILT[(family, name)]


def moe_fixtures(family: str, configs: dict[str, dict[str, Any]], num_mtp: int) -> tuple[Callable, Callable]:
    """-> (models, case) fixtures, parametrised over `configs` (name -> make_moe_checkpoint arguments)."""

    @pytest.fixture(scope="module", params=list(configs), ids=list(configs))
    def models(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> tuple:
        path, ours = build_moe(family, configs, num_mtp, request.param, tmp_path_factory)
        return load_hf_model(path), ours, request.param

    @pytest.fixture(scope="module", params=list(configs), ids=list(configs))
    def case(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> tuple:
        path, ours = build_moe(family, configs, num_mtp, request.param, tmp_path_factory)
        return Case(family, DEEPSEEK, num_mtp), path, MoEReference(path), ours

    return models, case
