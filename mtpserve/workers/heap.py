"""The start-up heap, kept out of the garbage collector's way once a process has started serving."""

from __future__ import annotations

import gc


def freeze_startup_heap() -> None:
    """Collect, then move every object alive now (the model, its graphs, compiled kernels, imported
    modules: a few hundred thousand) into the permanent generation, where no collection walks them.

    A full collection walks every tracked object: 139 ms on the 2-core CPU with the default model
    loaded, a stall of every request in flight (vLLM and SGLang freeze their start-up heap for the
    same reason). The price: cyclic garbage among the frozen objects is never freed, so this runs once,
    when a process's engine or worker has started, and tests unfreeze after each test.
    """
    gc.collect()
    gc.freeze()
