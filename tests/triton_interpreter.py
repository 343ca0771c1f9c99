"""Triton's interpreter for a test module: a package module's @triton.jit kernels run on the CPU; and the skip for
the interpreters that cannot run the project's loops."""

import importlib
import os
from contextlib import contextmanager
from importlib.metadata import version

import pytest
from versions import older_than

from tes_grpo.triton_support import module_interpreted


def loops_over_runtime_values() -> bool:
    """Whether this Triton's interpreter runs a kernel whose `range(...)` takes a runtime value (an argument, a
    program id, a loaded scalar: decode_attention's `range(first, last, ...)`, decode_linear's `range(0, K, ...)`).
    Triton before 3.7 turns the value into an int with int() on a 1-element array, which NumPy 2.4 refuses ("only
    0-dimensional arrays can be converted to Python scalars"; seen with Triton 3.6 and NumPy 2.4 and 2.5); 3.8 and
    3.9 squeeze it first. The compiled kernels are not affected."""
    return not older_than("triton", "3.7") or older_than("numpy", "2.4")


def runtime_loops(compiled_check: str):
    """skipif for a test whose kernel loops over a runtime value where this interpreter cannot (see
    loops_over_runtime_values); compiled_check: where the compiled kernel is checked instead."""
    return pytest.mark.skipif(
        not loops_over_runtime_values(),
        reason=f"Triton {version('triton')}'s interpreter (< 3.7) cannot loop over a runtime value under NumPy "
               f"{version('numpy')} (>= 2.4: int() of a 1-element array); {compiled_check}")


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
