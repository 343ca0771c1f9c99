"""Triton as an optional dependency: whether it is installed, and whether kernels run under its interpreter.

Library module at the bottom of the package: it imports nothing of the package and never Triton itself, so any
module may ask it before deciding whether to import Triton (fast_paths.py, mxfp4_experts.py) and every kernel module
asks it how its kernels were built.

Under TRITON_INTERPRET=1, `@triton.jit` gives an InterpretedFunction (kernels run on the CPU through NumPy) instead
of a JITFunction; it reads the variable when the kernel's module is imported. The kernels that compute differently
there (bf16 arithmetic on bits) take an INTERPRETED constant, passed as `interpreted(kernel)` at launch.
tests/triton_interpreter.py imports a kernel module under the variable and checks `module_interpreted(module)`.
"""

from __future__ import annotations

import importlib.util
import types


def triton_installed() -> bool:
    """Whether Triton can be imported (it is optional on the CPU; the GPU's fast paths need it)."""
    return importlib.util.find_spec("triton") is not None


def interpreted(kernel) -> bool:
    """Whether a @triton.jit kernel runs under Triton's interpreter (TRITON_INTERPRET=1 when its module was
    imported)."""
    return type(kernel).__name__ == "InterpretedFunction"


def module_interpreted(module: types.ModuleType) -> bool:
    """Whether the @triton.jit kernels a module defines run under Triton's interpreter: all of them (and it defines
    at least one)."""
    kernels = [value for value in vars(module).values()
               if type(value).__name__ in ("JITFunction", "InterpretedFunction")
               and getattr(getattr(value, "fn", None), "__module__", None) == module.__name__]
    return bool(kernels) and all(interpreted(kernel) for kernel in kernels)
