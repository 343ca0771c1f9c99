"""Flex attention's padded block masks, built three ways: transformers' compiled create_block_mask, the same eagerly,
and worked out per block from each row's bounds (what a run does).

Run on the GPU machine (the numbers go to BENCHMARKS.md):

    python benchmarks/bench_block_mask.py
    python benchmarks/bench_block_mask.py --SHAPES=8x4869,4x4869 --REPS=20

Why: transformers builds each padded batch's block mask with `torch.compile(create_block_mask)`; a cold first GRPO
step waits for those compilations (bench_grpo.py's compile report: create_block_mask), about as long as for flex
attention's own. The masks the project builds are each row's padding bounds within a causal or sliding-window mask,
so patches.transformers_patches.FlexMaskWithPaddingBounds works the block mask out per block instead (way
"bounds"); create_block_mask can also run eagerly (way "eager"), materialising the [batch, query, key] mask. This
times each way per shape and mask kind: the first call (compilation included), then one call, and the extra peak
memory, and checks that all give the same block mask.
"""

from __future__ import annotations

import sys as _sys
from pathlib import Path as _Path

_sys.path.insert(0, str(_Path(__file__).resolve().parents[1]))

import sys
import time

from benchmarks.timing import timed_ms
from tes_grpo.run.script_config import resolve

SHAPES = ("8x4869", "4x4869", "64x2048", "16x2335")  # rows x tokens: 20B and 120B passes at 4,000, a prefill, 1,024
SLIDING_WINDOW = 128  # gpt-oss's sliding layers' window
LEFT_PAD = 40  # every other row's prompt is this many tokens shorter (left padding), every third ends 100 early
REPS = 10  # timed calls per shape, kind and way, after the first
WAYS = ("compiled", "eager", "bounds")  # create_block_mask compiled (transformers') or eager; per block from bounds
KNOWN_WAYS = ("compiled", "eager", "bounds")
DEVICE = "cuda"  # cpu: a check of the script itself (small SHAPES; inductor's CPU backend compiles)


def parse_shape(shape: str) -> tuple[int, int]:
    """(rows, tokens) of a SHAPES entry "ROWSxTOKENS"; SystemExit naming the entry otherwise."""
    rows, _, tokens = shape.partition("x")
    if not (rows.isdigit() and tokens.isdigit() and int(rows) > 0 and int(tokens) > 0):
        raise SystemExit(f"error: SHAPES entry {shape!r}: expected ROWSxTOKENS with two positive whole numbers, "
                         "e.g. 8x4869")
    return int(rows), int(tokens)


def check_ways(ways) -> tuple[str, ...]:
    """WAYS as given when each is one this script builds; SystemExit naming the first that is not."""
    for way in ways:
        if way not in KNOWN_WAYS:
            raise SystemExit(f"error: WAYS entry {way!r}: expected one of {', '.join(KNOWN_WAYS)}")
    return tuple(ways)


def padded_mask(rows: int, length: int, device):
    """A 2-D 0/1 mask as TRL batches it: prompts left-padded, completions right-padded."""
    import torch

    mask = torch.ones(rows, length, dtype=torch.long, device=device)
    mask[1::2, :LEFT_PAD] = 0
    mask[::3, length - 100:] = 0
    return mask


def build(way: str, rows: int, length: int, sliding: bool, mask):
    """The block mask of a padded batch: through transformers' flex_attention_mask with each row's bounds as the mask
    function and create_block_mask compiled (way "compiled", transformers' own) or eager, or worked out per block
    from the bounds (way "bounds": patches.transformers_patches.FlexMaskWithPaddingBounds, what a run does)."""
    import transformers.masking_utils as mu
    from torch.nn.attention.flex_attention import create_block_mask

    from tes_grpo.patches.transformers_patches import BoundedMask, FlexMaskWithPaddingBounds, padding_bounds

    mask_function = mu.sliding_window_causal_mask_function(SLIDING_WINDOW) if sliding else mu.causal_mask_function
    shape = dict(batch_size=rows, q_length=length, kv_length=length, q_offset=0, kv_offset=0, device=mask.device,
                 local_size=SLIDING_WINDOW if sliding else None)
    if way == "bounds":
        return FlexMaskWithPaddingBounds(mu.flex_attention_mask)(mask_function=mask_function, attention_mask=mask,
                                                                 **shape)
    original = mu.create_block_mask
    if way == "eager":
        mu.create_block_mask = lambda *args, _compile=False, **kwargs: create_block_mask(*args, **kwargs)
    try:
        return mu.flex_attention_mask(mask_function=BoundedMask(mask_function, *padding_bounds(mask)),
                                      attention_mask=None, **shape)
    finally:
        mu.create_block_mask = original


def main(argv: list[str] | None = None) -> int:
    s = resolve(globals(), argv)
    import torch

    from benchmarks.log_header import header
    from tes_grpo.model.gpt_oss_shapes import stack_versions

    print(header(), flush=True)
    device = torch.device(s.DEVICE)
    cuda = device.type == "cuda"
    results = []
    shapes = [parse_shape(shape) for shape in s.SHAPES]  # every entry checked before anything runs
    check_ways(s.WAYS)
    for shape, (rows, length) in zip(s.SHAPES, shapes, strict=True):
        mask = padded_mask(rows, length, device)
        for sliding in (False, True):
            blocks = {}
            for way in s.WAYS:
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
            same = all(torch.equal(getattr(blocks[s.WAYS[0]], f), getattr(blocks[way], f)) for way in s.WAYS
                       for f in ("kv_num_blocks", "kv_indices", "full_kv_num_blocks", "full_kv_indices",
                                 "q_num_blocks", "q_indices"))
            print(f"{shape} {'sliding' if sliding else 'full'}: the same block mask every way: {same}", flush=True)
            if not same:
                return 1
    print(f"\n{stack_versions()}; sliding window {SLIDING_WINDOW}, rows padded as TRL pads them")
    print(f"{'rows x tokens':<14}{'mask':<9}{'way':<10}{'first call s':>13}{'ms a call':>10}{'extra GiB':>10}")
    for shape, kind, way, first, ms, extra in results:
        print(f"{shape:<14}{kind:<9}{way:<10}{first:>13.2f}{ms:>10.2f}{extra:>10.2f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
