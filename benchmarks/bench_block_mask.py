"""Flex attention's padded block masks, built as a run builds them, compiled (transformers' way) against eagerly.

Run on the GPU machine (the numbers go to BENCHMARKS.md):

    python benchmarks/bench_block_mask.py
    python benchmarks/bench_block_mask.py --SHAPES=8x4869,4x4869 --REPS=20

Why: transformers builds each padded batch's block mask with `torch.compile(create_block_mask)`; in a cold first GRPO
step those compilations took ~30 s (bench_grpo.py's compile report: create_block_mask, 4 graphs), about as long as
flex attention's own. The masks the project builds are each row's padding bounds within a causal or sliding-window
mask (patches.transformers_patches.FlexMaskWithPaddingBounds), for which create_block_mask runs eagerly too: it
materialises the [batch, query, key] mask once per forward instead. This times both per shape and mask kind: the
first call (compilation included), then one call, and the eager form's extra peak memory, so the trade (a cold
step's compile seconds against each forward's build) is measured before any default changes. It also checks that
both give the same block mask.
"""

from __future__ import annotations

import sys as _sys
from pathlib import Path as _Path

_sys.path.insert(0, str(_Path(__file__).resolve().parents[1]))

import sys
import time

from benchmarks.timing import timed_ms
from tes_grpo.script_config import resolve

SHAPES = ("8x4869", "4x4869", "64x2048", "16x2335")  # rows x tokens: 20B and 120B passes at 4,000, a prefill, 1,024
SLIDING_WINDOW = 128  # gpt-oss's sliding layers' window
LEFT_PAD = 40  # every other row's prompt is this many tokens shorter (left padding), every third ends 100 early
REPS = 10  # timed calls per shape, kind and way, after the first
DEVICE = "cuda"  # cpu: a check of the script itself (small SHAPES; inductor's CPU backend compiles)


def parse_shape(shape: str) -> tuple[int, int]:
    """(rows, tokens) of a SHAPES entry "ROWSxTOKENS"; SystemExit naming the entry otherwise."""
    rows, _, tokens = shape.partition("x")
    if not (rows.isdigit() and tokens.isdigit() and int(rows) > 0 and int(tokens) > 0):
        raise SystemExit(f"error: SHAPES entry {shape!r}: expected ROWSxTOKENS with two positive whole numbers, "
                         "e.g. 8x4869")
    return int(rows), int(tokens)


def padded_mask(rows: int, length: int, device):
    """A 2-D 0/1 mask as TRL batches it: prompts left-padded, completions right-padded."""
    import torch

    mask = torch.ones(rows, length, dtype=torch.long, device=device)
    mask[1::2, :LEFT_PAD] = 0
    mask[::3, length - 100:] = 0
    return mask


def build(way: str, rows: int, length: int, sliding: bool, mask):
    """The block mask transformers' flex_attention_mask gives through FlexMaskWithPaddingBounds, with
    create_block_mask compiled (way "compiled", transformers') or eager."""
    import transformers.masking_utils as mu
    from torch.nn.attention.flex_attention import create_block_mask

    from tes_grpo.patches.transformers_patches import FlexMaskWithPaddingBounds

    function = FlexMaskWithPaddingBounds(mu.flex_attention_mask)
    mask_function = mu.sliding_window_causal_mask_function(SLIDING_WINDOW) if sliding else mu.causal_mask_function
    original = mu.create_block_mask
    if way == "eager":
        mu.create_block_mask = lambda *args, _compile=False, **kwargs: create_block_mask(*args, **kwargs)
    try:
        return function(batch_size=rows, q_length=length, kv_length=length, q_offset=0, kv_offset=0,
                        mask_function=mask_function, attention_mask=mask, device=mask.device)
    finally:
        mu.create_block_mask = original


def main(argv: list[str] | None = None) -> int:
    s = resolve(globals(), argv)
    import torch

    from tes_grpo.gpt_oss_shapes import stack_versions

    print(stack_versions())
    device = torch.device(s.DEVICE)
    cuda = device.type == "cuda"
    results = []
    shapes = [parse_shape(shape) for shape in s.SHAPES]  # every entry checked before anything runs
    for shape, (rows, length) in zip(s.SHAPES, shapes, strict=True):
        mask = padded_mask(rows, length, device)
        for sliding in (False, True):
            blocks = {}
            for way in ("compiled", "eager"):
                if cuda:
                    torch.cuda.synchronize()
                    torch.cuda.reset_peak_memory_stats()
                held = torch.cuda.memory_allocated() if cuda else 0
                start = time.perf_counter()
                blocks[way] = build(way, rows, length, sliding, mask)
                if cuda:
                    torch.cuda.synchronize()
                first = time.perf_counter() - start
                ms = timed_ms(lambda way=way, rows=rows, length=length, sliding=sliding, mask=mask: build(
                    way, rows, length, sliding, mask), s.REPS)
                extra = (torch.cuda.max_memory_allocated() - held) / 2**30 if cuda else float("nan")
                results.append((shape, "sliding" if sliding else "full", way, first, ms, extra))
                print(results[-1], flush=True)
            same = all(torch.equal(getattr(blocks["compiled"], f), getattr(blocks["eager"], f))
                       for f in ("kv_num_blocks", "kv_indices", "full_kv_num_blocks", "full_kv_indices"))
            print(f"{shape} {'sliding' if sliding else 'full'}: the same block mask both ways: {same}", flush=True)
            if not same:
                return 1
    print(f"\n{stack_versions()}; sliding window {SLIDING_WINDOW}, rows padded as TRL pads them")
    print(f"{'rows x tokens':<14}{'mask':<9}{'way':<10}{'first call s':>13}{'ms a call':>10}{'extra GiB':>10}")
    for shape, kind, way, first, ms, extra in results:
        print(f"{shape:<14}{kind:<9}{way:<10}{first:>13.2f}{ms:>10.2f}{extra:>10.2f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
