"""A decode step's attention projections (and the router's product) at gpt-oss-20b's shapes, per implementation, on one
GPU: time inside a CUDA graph, the weights' read rate, and the bits against cuBLAS. Run on the GPU machine (the
numbers go to BENCHMARKS.md):

    python benchmarks/bench_decode_linear.py
    python benchmarks/bench_decode_linear.py --ROWS=128 --TRITON=auto,64/128/4/4,32/128/4/5

Shapes: q, k and v (three weights read for the same rows, LoRA rank LORA_R each, biases), o (one weight, LoRA), and
the router (32 outputs, bias, no adapter). Implementations: "cublas", the products as decode_math computed them
before decode_linear.py (F.linear for each weight under the trainer's bf16 autocast, then layers/lora.py's LowRank's two
products and decode_glue's add compiled); and decode_linear.linear once per TRITON entry: BLOCK_N/BLOCK_K/warps/stages,
or "auto" (its defaults, what a decode step runs). Each call is timed as a decode
step runs it, captured REPS times in one CUDA graph and replayed (outside a graph the host's launches, not the GPU,
would set the pace). Each implementation's bf16 results against the float64 sums rounded where PEFT's forward rounds
(the bias added before the base product's rounding): the share of elements that differ, and the largest difference
in units of the largest element's last place (relative ulps: a sum that cancels to near zero can differ by many of
its own ulps when an operand differs by one of its).
"""

from __future__ import annotations

import sys as _sys
from pathlib import Path as _Path

_sys.path.insert(0, str(_Path(__file__).resolve().parents[1]))

import sys

from tes_grpo.run.script_config import resolve

ROWS = 64  # rows a decode step multiplies (the sequences decoded together)
LORA_R = 4  # LoRA rank of each attention projection (the recipe's)
LORA_SCALE = 2.0  # LoRA alpha / r (the recipe's 8 / 4)
REPS = 50  # calls captured in the timed graph
PRODUCTS = ("qkv", "o", "router")  # which products to time (of these three)
TRITON = ("auto", "64/128/4/3", "32/128/4/4", "32/128/4/5", "64/64/4/4")  # BLOCK_N/BLOCK_K/warps/stages, or auto


def triton_entry(entry: str) -> tuple[int, int, int, int] | None:
    """A TRITON entry ("64/128/4/4", "auto") -> decode_linear.linear's tiles (None: its defaults); ValueError names
    the entry and the syntax otherwise."""
    if entry == "auto":
        return None
    values = entry.split("/")
    if len(values) != 4 or not all(v.strip().isdigit() and int(v) > 0 for v in values):
        raise ValueError(f"TRITON: {entry!r} is not BLOCK_N/BLOCK_K/warps/stages (positive whole numbers) or auto")
    return tuple(int(v) for v in values)


def graph_us(fn, reps: int) -> float:
    """Microseconds a call of fn() takes replayed in a CUDA graph of `reps` calls (after a warm-up call)."""
    import torch

    fn()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(reps):
            fn()
    graph.replay()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(5):
        graph.replay()
    end.record()
    torch.cuda.synchronize()
    return 1000 * start.elapsed_time(end) / (5 * reps)


def distance(result, reference, reference_after) -> tuple[float, float, float]:
    """(share of result's elements that differ from reference, share that differ from reference_after, largest
    difference from reference in ulps of its largest |element|), all bf16 tensors of one shape."""
    import torch

    unit = reference.float().abs().max() * torch.finfo(torch.bfloat16).eps
    return (float((result != reference).float().mean()), float((result != reference_after).float().mean()),
            float((result.float() - reference.float()).abs().max() / unit))


def main(argv: list[str] | None = None) -> int:
    s = resolve(globals(), argv)
    try:
        entries = {entry: triton_entry(entry) for entry in s.TRITON}
    except ValueError as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    import torch

    from benchmarks.log_header import header
    from tes_grpo.layers import decode_glue
    from tes_grpo.layers.lora import low_rank
    from tes_grpo.sampling import decode_linear

    print(header(), flush=True)
    torch.manual_seed(0)
    bf16 = torch.bfloat16
    hidden, q, kv = 2880, 4096, 512

    def weights(*sizes, k):
        return [(torch.randn(n, k, device="cuda") * k ** -0.5).to(bf16) for n in sizes]

    def lora(sizes, k):
        factors = [(torch.randn(s.LORA_R, k, device="cuda") * k ** -0.5,
                    torch.randn(n, s.LORA_R, device="cuda") * 1e-2, s.LORA_SCALE) for n in sizes]
        return low_rank(factors, bf16)

    shapes = {  # name: (x, weights, bias, LowRank or None)
        "qkv": (hidden, weights(q, kv, kv, k=hidden), lora((q, kv, kv), hidden)),
        "o": (q, weights(hidden, k=q), lora((hidden,), q)),
        "router": (hidden, weights(32, k=hidden), None),
    }
    add_lora = decode_glue.compiled(decode_glue.add_lora)
    rows = []
    for name, (k, ws, low) in shapes.items():
        if name not in s.PRODUCTS:
            continue
        x = torch.randn(s.ROWS, 1, k, device="cuda").to(bf16)
        biases = [(torch.randn(w.shape[0], device="cuda") * 0.1).to(bf16) for w in ws]

        def cublas(x=x, ws=ws, biases=biases, low=low):
            with torch.autocast("cuda", dtype=bf16, cache_enabled=False):
                outs = [torch.nn.functional.linear(x, w, b) for w, b in zip(ws, biases, strict=True)]
                return outs if low is None else add_lora(outs, list(low(x)))

        bias = torch.cat(biases)
        factors = None if low is None else (low.a, low.b, low.scale)
        expected = (decode_linear.reference(x, ws, bias, factors),
                    decode_linear.reference(x, ws, bias, factors, bias_after_rounding=True))
        gb = sum(w.numel() for w in ws) * 2 / 1e9
        us = graph_us(cublas, s.REPS)
        rows.append((name, "cublas", us, gb / us * 1e6, *distance(torch.cat(cublas(), dim=-1), *expected)))
        print(rows[-1], flush=True)
        for entry, tiles in entries.items():
            def ours(x=x, ws=ws, bias=bias, factors=factors, tiles=tiles):
                return decode_linear.linear(x, ws, bias, factors, tiles=tiles)

            us = graph_us(ours, s.REPS)
            rows.append((name, f"triton {entry}", us, gb / us * 1e6, *distance(ours(), *expected)))
            print(rows[-1], flush=True)
    print(f"\n{s.ROWS} rows, LoRA r{s.LORA_R} x {s.LORA_SCALE} on q, k, v and o; GB/s counts the weights read once; "
          "differ: the share of elements other than the float64 sums rounded as PEFT rounds (the bias added before "
          "the base product's rounding), bias after: the same with the bias added after it; max ulp: the largest "
          "difference from the first, in ulps of the largest element")
    print(f"{'product':<8}{'implementation':<26}{'us':>8}{'GB/s':>8}{'differ':>9}{'bias after':>11}{'max ulp':>9}")
    for name, impl, us, rate, share, share_after, worst in rows:
        print(f"{name:<8}{impl:<26}{us:>8.1f}{rate:>8.0f}{share:>9.2%}{share_after:>11.2%}{worst:>9.2f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
