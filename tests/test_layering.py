"""The data plane never imports the control plane (docs/design.md §1): workers/ and kernels/ see the
per-step messages through mtpserve.boundary only, so a worker process loads no scheduler or router."""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

PACKAGE = Path(__file__).resolve().parent.parent / "mtpserve"


def _imports(path: Path) -> list[str]:
    names = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and node.module:
            names.append(node.module)
        elif isinstance(node, ast.Import):
            names += [alias.name for alias in node.names]
    return names


def test_data_plane_and_boundary_never_import_the_control_plane() -> None:
    offenders = {
        f"{path.relative_to(PACKAGE)} imports {name}"
        for part in ("workers", "kernels", "boundary")
        for path in (PACKAGE / part).rglob("*.py")
        for name in _imports(path)
        if name.startswith("mtpserve.cluster")
    }
    assert not offenders, sorted(offenders)


def test_a_worker_process_loads_no_control_plane_module() -> None:
    code = ("import sys, mtpserve.workers.worker, mtpserve.workers.local_executor; "
            "print(sorted(m for m in sys.modules if m.startswith('mtpserve.cluster')))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=True)
    assert out.stdout.strip() == "[]", out.stdout
