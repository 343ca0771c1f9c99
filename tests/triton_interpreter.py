"""Triton's interpreter for a test module: a package module's @triton.jit kernels run on the CPU."""

import importlib
import os
from contextlib import contextmanager

from tes_grpo.triton_support import module_interpreted


@contextmanager
def interpreted(module_name: str):
    """TRITON_INTERPRET=1 inside (the interpreter reads it while kernels run, too), with `module_name` imported, or
    re-imported, under it: yields the module, whose kernels are then interpreted (triton_support.module_interpreted
    says so). After, the variable is restored and, unless it was 1 before, the module re-imported with compiled
    kernels, so that later tests in the process (the CUDA ones on a GPU machine) run compiled kernels again. Modules
    that use the kernels read them as attributes of that module when they launch, so they follow both re-imports."""
    before = os.environ.get("TRITON_INTERPRET")
    os.environ["TRITON_INTERPRET"] = "1"
    module = None
    try:
        module = importlib.import_module(module_name)
        if not module_interpreted(module):
            module = importlib.reload(module)
        assert module_interpreted(module)
        yield module
    finally:
        if before is None:
            del os.environ["TRITON_INTERPRET"]
        else:
            os.environ["TRITON_INTERPRET"] = before
        if module is not None and before != "1":
            importlib.reload(module)
