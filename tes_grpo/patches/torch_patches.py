"""Patches and private reads of torch, each with the torch versions it was checked on and why.

registry.PATCHED (tes_grpo/patches/registry.py) records the shape of every torch function these rely on;
tests/test_patches.py fails when an installed torch changes one, naming the patch to re-check.
"""

from __future__ import annotations

import torch
import torch.distributed as dist


def _top_saved_tensors_hooks():
    return getattr(torch._C._autograd, "_top_saved_tensors_default_hooks", None)


def saved_tensors_hooks_readable() -> bool:
    """Whether this torch lets saved_tensors_hooks_now read the active hooks."""
    return _top_saved_tensors_hooks() is not None


def saved_tensors_hooks_now():
    """torch 2.8-2.13: the saved-tensor hooks active in this thread now, (pack, unpack), or None.

    torch applies only the innermost torch.autograd.graph.saved_tensors_hooks, so the hooks mxfp4_experts.py sets
    around a resident experts call (to keep the dequantized weights out of autograd's saved tensors) would shadow
    gradient checkpointing's inside a checkpointed layer, and that layer's activations would be kept; it hands every
    other tensor to the hooks returned here. torch has no public way to read them, only the private
    torch._C._autograd._top_saved_tensors_default_hooks(ignore_is_tracing). RuntimeError when it is gone.
    """
    top = _top_saved_tensors_hooks()
    if top is None:
        raise RuntimeError(f"torch {torch.__version__} has no torch._C._autograd._top_saved_tensors_default_hooks: "
                           "resident MXFP4 experts cannot leave gradient checkpointing's hooks in charge "
                           "(EXPERTS=bf16 loads the experts dequantized)")
    return top(False)


def leave_process_group(wait: bool) -> bool:
    """torch 2.11-2.13: destroys the process group before Python exits.

    Left to the interpreter's finalization, gloo's worker threads can release tensors after the interpreter is gone
    and abort the process with SIGABRT ("terminate called without an active exception"; seen in the DDP resume test
    on the CPU, after its last step). wait: meet every process first, so none leaves while another still needs it
    (only on success: after an error one process may never arrive). Returns whether there was a group to leave."""
    if not (dist.is_available() and dist.is_initialized()):
        return False
    if wait:
        dist.barrier()
    dist.destroy_process_group()
    return True
