"""One decode step's attention over a full-attention layer's cache, per implementation, on one GPU: time and distance
from the exact (float64) result. Run on the GPU machine (the numbers go to BENCHMARKS.md):

    python benchmarks/bench_decode_attention.py
    python benchmarks/bench_decode_attention.py --LENGTHS=1536,5376 --ROWS=128
    python benchmarks/bench_decode_attention.py --LENGTHS=128,2048,4096 --FLEX=0,2,4,8,8/128 --ONE_QUERY=0
    python benchmarks/bench_decode_attention.py --LENGTHS=128,2048,4096 --ONE_QUERY=0 --TRITON=64/4/3,32/4/3,128/4/3

Implementations: decode_math.one_query_attention eagerly and compiled (ONE_QUERY); decode_math.attention_with_sinks
with flex attention's decoding kernel, compiled whole, once per FLEX entry: SPLIT[/BLOCK_N[/num_warps/num_stages]],
flex attention's kernel options (decode_math.flex_decode_kernel; 0 leaves an option to flex attention, a SPLIT of 0
its own split); and attention_with_sinks with decode_attention.py's kernel (what attention_function gives a GPU), once
per TRITON entry: its tiles, the sink step compiled as decode_glue's is. Every slot of the cache is seen (no slots
past the token to skip), so all read the same bytes. The keys, values and mask are a cache-length view of a longer
buffer, as StaticCache.write returns them, the length marked dynamic as decode_step marks it; the last line counts
the graphs torch.compile built over all lengths for the flex and compiled one-query entries (1 = one kernel set for
every bucket).
"""

from __future__ import annotations

import sys as _sys
from pathlib import Path as _Path

_sys.path.insert(0, str(_Path(__file__).resolve().parents[1]))

import functools
import sys

from tes_grpo.run.script_config import resolve

ROWS = 64  # sequences decoded together (4 prompts x 16 at the reference recipe)
LENGTHS = (1536, 2560, 3584, 5376)  # cache lengths (a decode step attends over its 512-slot bucket of the cache)
MASKED = 40  # leading slots masked in every other row (left padding)
REPS = 50  # timed calls per measurement
ONE_QUERY = True  # also time decode_math.one_query_attention, eager and compiled
FLEX = ("0",)  # flex decoding kernel options per entry: SPLIT[/BLOCK_N[/num_warps/num_stages]], 0 = flex's own
TRITON = ("64/4/3",)  # decode_attention.py's kernel per entry: slots a loop step/warps/stages (64/4/3: its default)


def flex_options(entry: str) -> dict:
    """A FLEX entry ("8", "8/128", "8/64/4/2") -> flex attention's kernel options it sets (0s left out); ValueError
    names the entry and the syntax otherwise."""
    values = entry.split("/")
    if len(values) not in (1, 2, 4) or not all(v.strip().isdigit() for v in values):
        raise ValueError(f"FLEX: {entry!r} is not SPLIT[/BLOCK_N[/num_warps/num_stages]] (whole numbers, 0 = flex "
                         f"attention's own)")
    names = ("SPLIT_KV", "BLOCK_N", "num_warps", "num_stages")
    return {name: int(v) for name, v in zip(names, values, strict=False) if int(v)}


def triton_tiles(entry: str) -> tuple[int, int, int]:
    """A TRITON entry ("64/4/3") -> decode_attention.attention's tiles; ValueError names the entry and the syntax
    otherwise."""
    values = entry.split("/")
    if len(values) != 3 or not all(v.strip().isdigit() and int(v) > 0 for v in values):
        raise ValueError(f"TRITON: {entry!r} is not BLOCK_N/num_warps/num_stages (positive whole numbers)")
    return int(values[0]), int(values[1]), int(values[2])


def main(argv: list[str] | None = None) -> int:
    s = resolve(globals(), argv)
    try:
        variants = {entry: flex_options(entry) for entry in s.FLEX}
        tiles = {entry: triton_tiles(entry) for entry in s.TRITON}
    except ValueError as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    import torch
    from torch._dynamo.utils import counters

    from benchmarks.log_header import header
    from benchmarks.timing import timed_ms
    from tes_grpo.sampling import decode_math

    print(header(), flush=True)
    heads, kv_heads, dim = 64, 8, 64
    torch.manual_seed(0)
    total = max(s.LENGTHS) + 512
    buffers = [torch.randn(s.ROWS, kv_heads, total, dim, device="cuda", dtype=torch.bfloat16) for _ in range(2)]
    sinks = torch.randn(heads, device="cuda", dtype=torch.bfloat16)
    implementations = {}
    if s.ONE_QUERY:
        implementations["one_query eager"] = decode_math.one_query_attention
        implementations["one_query compiled"] = torch.compile(decode_math.one_query_attention, fullgraph=True,
                                                              options={"emulate_precision_casts": True})
    for entry, options in variants.items():
        kernel = functools.partial(decode_math.flex_decode_kernel, kernel_options=options or None)
        implementations[f"flex {entry}"] = torch.compile(
            functools.partial(decode_math.attention_with_sinks, kernel=kernel), fullgraph=True)
    from tes_grpo.layers import decode_glue
    from tes_grpo.sampling import decode_attention
    sink_step = decode_glue.compiled(decode_glue.with_sinks)
    for entry, tile in tiles.items():
        kernel = functools.partial(decode_attention.attention, tiles=tile)
        implementations[f"triton {entry}"] = functools.partial(decode_math.attention_with_sinks, kernel=kernel,
                                                               sink_step=sink_step)
    # every variant shares flex_decode_kernel's code object, whose compiled entries dynamo caps at 8 by default
    torch._dynamo.config.recompile_limit = max(torch._dynamo.config.recompile_limit, 4 * len(implementations))
    graphs = dict.fromkeys(implementations, 0)
    rows = []
    for length in s.LENGTHS:
        query = torch.randn(s.ROWS, heads, 1, dim, device="cuda", dtype=torch.bfloat16)
        keys, values = (b[:, :, :length] for b in buffers)
        mask = torch.zeros(s.ROWS, length, device="cuda")
        mask[1::2, :s.MASKED] = torch.finfo(torch.float32).min
        for t, d in ((keys, 2), (values, 2), (mask, 1)):
            torch._dynamo.maybe_mark_dynamic(t, d)
        args = (query, keys, values, mask, sinks)
        exact = decode_math.one_query_attention(*(t.double() for t in args), dim ** -0.5)
        for name, fn in implementations.items():
            before = counters["stats"]["unique_graphs"]
            out = fn(*args, dim ** -0.5)
            graphs[name] += counters["stats"]["unique_graphs"] - before
            error = (out.double() - exact).abs()
            ms = timed_ms(lambda fn=fn, args=args: fn(*args, dim ** -0.5), s.REPS)
            gb = 2 * keys.numel() * keys.element_size() / 1e9  # keys and values read once
            rows.append((length, name, ms, gb / ms, error.mean().item(), error.max().item()))
            print(rows[-1], flush=True)
    print(f"\n{s.ROWS} rows, {heads} query / {kv_heads} key-value heads of {dim}, bf16 cache; GB/s counts the keys and "
          f"values read once")
    print(f"{'length':>7}  {'implementation':<20}{'us':>8}{'GB/s':>8}{'mean |err|':>12}{'max |err|':>11}")
    for length, name, ms, rate, mean, worst in rows:
        print(f"{length:>7}  {name:<20}{1000 * ms:>8.1f}{rate * 1000:>8.0f}{mean:>12.2e}{worst:>11.2e}")
    compiled = (f"{name} {count}" for name, count in graphs.items()
                if name != "one_query eager" and not name.startswith("triton"))
    print("graphs compiled over all lengths: " + ", ".join(compiled))
    return 0


if __name__ == "__main__":
    sys.exit(main())
