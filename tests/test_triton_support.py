"""tes_grpo/triton_support.py: the Triton probe and how a module's kernels were built (compiled or interpreted)."""

from __future__ import annotations

import importlib.util

import pytest
from triton_interpreter import interpreted as under_interpreter

from tes_grpo import triton_support


def test_triton_installed_is_whether_it_imports():
    assert triton_support.triton_installed() is (importlib.util.find_spec("triton") is not None)


def test_a_module_without_kernels_is_not_interpreted():
    assert not triton_support.module_interpreted(triton_support)


def test_kernels_built_under_the_interpreter_and_after():
    pytest.importorskip("triton", reason="requirements-test.txt installs triton")
    with under_interpreter("tes_grpo.experts.moe_routing") as routing:
        assert triton_support.interpreted(routing._route_kernel)
        assert triton_support.module_interpreted(routing)
    assert not triton_support.interpreted(routing._route_kernel)  # re-imported compiled: the module's new kernel
    assert not triton_support.module_interpreted(routing)
