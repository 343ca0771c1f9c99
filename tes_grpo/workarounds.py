"""Workarounds for library behaviour, in one place: each says the library version it serves and why.

Delete one when the library it works around no longer needs it (each checks for the hook it patches and says so
when the hook is gone).
"""

from __future__ import annotations

import contextlib


def _say(message: str) -> None:
    from tes_grpo.processes import say

    say(message)


def keep_grouped_mm_experts_for_decode(model, say=_say) -> bool:
    """transformers 5.17-5.23: stops generate() from switching grouped_mm experts to batched_mm for decoding.

    transformers (on GPUs) swaps in `batched_mm` for the decode phase, which gathers every token's expert weights:
    fast for a few sequences, but GRPO decodes 64 at once, where it ran out of memory on an H100 and was 3x slower
    (BENCHMARKS.md). Permanent for this model object; returns whether there was a switch to turn off.
    """
    inner = model.get_base_model() if hasattr(model, "get_base_model") else model
    if not hasattr(inner, "_optimize_model_for_decode"):
        say("note: this transformers has no decode-time experts switch; nothing to keep")
        return False
    inner._optimize_model_for_decode = contextlib.nullcontext
    return True


@contextlib.contextmanager
def grouped_mm_experts_for_decode(model, say=_say):
    """keep_grouped_mm_experts_for_decode for the duration of a with-block (transformers' switch comes back after)."""
    inner = model.get_base_model() if hasattr(model, "get_base_model") else model
    kept = keep_grouped_mm_experts_for_decode(model, say)
    try:
        yield model
    finally:
        if kept:
            del inner._optimize_model_for_decode
