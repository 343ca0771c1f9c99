"""gpt-oss attention at a GRPO training micro-batch's shape through transformers' flex_attention path, per
kernel_options, on one GPU. Run on the GPU machine (the numbers go to BENCHMARKS.md):

    python benchmarks/bench_flex_attention.py
    python benchmarks/bench_flex_attention.py --ROWS=8 --LENGTH=4871 --KERNEL_OPTIONS="{},fwd_BLOCK_M=64 fwd_BLOCK_N=64"

Why: profiling one training micro-batch at 1,024-token completions (bench_grpo.py --PROFILE_TRAIN=1) put flex
attention's forward kernel at 24 % of the GPU time, 25 ms a call, while its backward took 7.6 ms a call, though a
backward does ~2.5x a forward's arithmetic. This times the forward alone and forward + backward, for a full (causal)
and a sliding-window layer, with transformers' own function (sinks applied through the returned LSE), for each
entry of KERNEL_OPTIONS, and SDPA's flash kernel (no sinks: a speed reference, not a substitute) beside them.
An entry is flex attention's kernel_options written as space-separated NAME=value pairs (no commas, so a list of them
fits one command-line value; "{}" is flex attention's own choice); a fwd_ or bwd_ prefix applies a setting to that
pass only. With COMBINE_BEST, a last row per layer joins the fastest entry's fwd_ settings to the fastest entry's
bwd_ settings (settings without a prefix are not carried over).
"""

from __future__ import annotations

import sys as _sys
from pathlib import Path as _Path

_sys.path.insert(0, str(_Path(__file__).resolve().parents[1]))

import math
import sys

from benchmarks.timing import timed_ms
from tes_grpo.run.script_config import resolve

ROWS = 16  # sequences in the micro-batch (TRAIN_BATCH_SIZE=auto picks 16 at 1,024-token completions)
LENGTH = 2335  # tokens per sequence (1,311-token prompt + 1,024 completion)
LEFT_PAD = 40  # the shortest prompt is this many tokens shorter (left padding, masked)
REPS = 5  # timed calls per measurement
WARM_LENGTHS = 0  # >0: first run forward + backward at this many other lengths, as training's micro-batches vary
DYNAMIC = "auto"  # auto: transformers' torch.compile(flex_attention); false: compiled with dynamic=False instead
TIME_NO_GRAD = True  # also time a forward under no_grad (one more compilation per entry)
COMBINE_BEST = False  # add a row per layer: the fastest forward's fwd_ settings with the fastest backward's bwd_ ones
AUTOCAST = False  # run under torch.autocast(bf16), as accelerate runs the training forward with bf16=True
NO_AUTOCAST_INSIDE = False  # with AUTOCAST: switch autocast off around the attention call (how much autocast costs)
# kernel_options tried, each as NAME=value pairs ("{}" = flex attention's own choice)
KERNEL_OPTIONS = ("{}", "BLOCK_M=64 BLOCK_N=64", "BLOCK_M=128 BLOCK_N=64",
                  "BLOCK_M=128 BLOCK_N=128 num_warps=8 num_stages=2")


def parse_kernel_options(text: str) -> dict | None:
    """'fwd_BLOCK_M=64 bwd_num_warps=4 USE_TMA=true' -> {'fwd_BLOCK_M': 64, ...}; '{}' or '' -> None."""
    options = {}
    for pair in text.split():
        if pair == "{}":
            continue
        name, sep, value = pair.partition("=")
        if not sep or not name:
            raise SystemExit(f"error: KERNEL_OPTIONS entry {text!r}: {pair!r} is not NAME=value")
        low = value.lower()
        options[name] = True if low == "true" else False if low == "false" else int(value) if value.isdigit() else value
    return options or None


def only(options: str, prefix: str) -> dict:
    """The settings of a KERNEL_OPTIONS entry whose names start with prefix."""
    return {k: v for k, v in (parse_kernel_options(options) or {}).items() if k.startswith(prefix)}


def joined(options: list[dict | None]) -> str:
    """kernel_options back in KERNEL_OPTIONS' text form."""
    pairs = [f"{k}={str(v).lower() if isinstance(v, bool) else v}" for o in options if o for k, v in o.items()]
    return " ".join(pairs) or "{}"


def main(argv: list[str] | None = None) -> int:
    s = resolve(globals(), argv)
    import torch
    from torch.nn.attention.flex_attention import create_block_mask
    from transformers.integrations.flex_attention import flex_attention_forward

    from benchmarks.log_header import header

    print(header(), flush=True)
    # each entry x layer x grad mode is a new compilation; past the limit (8) flex attention would run unfused
    torch._dynamo.config.recompile_limit = 256
    torch._dynamo.config.accumulated_recompile_limit = 4096
    torch.manual_seed(0)
    heads, kv_heads, dim, window = 64, 8, 64, 128
    pad = torch.zeros(s.ROWS, dtype=torch.long, device="cuda")
    pad[1::2] = s.LEFT_PAD

    def full(b, h, q, kv):
        return (kv <= q) & (kv >= pad[b])

    def sliding(b, h, q, kv):
        return (kv <= q) & (kv >= pad[b]) & (q - kv < window)

    masks = {name: create_block_mask(fn, s.ROWS, None, s.LENGTH, s.LENGTH, device="cuda")
             for name, fn in (("full", full), ("sliding", sliding))}
    module = torch.nn.Module().train()
    sinks = torch.randn(heads, device="cuda", dtype=torch.bfloat16)

    def tensors():
        q = torch.randn(s.ROWS, heads, s.LENGTH, dim, device="cuda", dtype=torch.bfloat16, requires_grad=True)
        k = torch.randn(s.ROWS, kv_heads, s.LENGTH, dim, device="cuda", dtype=torch.bfloat16, requires_grad=True)
        v = torch.randn(s.ROWS, kv_heads, s.LENGTH, dim, device="cuda", dtype=torch.bfloat16, requires_grad=True)
        return q, k, v

    if s.DYNAMIC == "false":
        from torch.nn.attention.flex_attention import flex_attention
        from transformers.integrations.flex_attention import WrappedFlexAttention

        wrapped = WrappedFlexAttention(True)
        wrapped._compiled_flex_attention = torch.compile(flex_attention, dynamic=False)
    for i in range(s.WARM_LENGTHS):  # automatic dynamic shapes: a second length recompiles for symbolic sizes
        length = s.LENGTH - 64 * (i + 1)
        mask = create_block_mask(full, s.ROWS, None, length, length, device="cuda")
        shape = (s.ROWS, heads, length, dim), (s.ROWS, kv_heads, length, dim)
        qw = torch.randn(shape[0], device="cuda", dtype=torch.bfloat16, requires_grad=True)
        kw, vw = (torch.randn(shape[1], device="cuda", dtype=torch.bfloat16, requires_grad=True) for _ in range(2))
        flex_attention_forward(module, qw, kw, vw, mask, scaling=dim ** -0.5, s_aux=sinks)[0].sum().backward()
    q, k, v = tensors()
    grad = torch.randn(s.ROWS, s.LENGTH, heads, dim, device="cuda", dtype=torch.bfloat16)
    rows = []

    def measure(options: str, name: str, mask) -> None:
        kernel_options = parse_kernel_options(options)

        def forward(mask=mask, kernel_options=kernel_options):
            # only the attention call runs here, so autocast switched off inside it is autocast off
            with torch.autocast("cuda", dtype=torch.bfloat16, enabled=s.AUTOCAST and not s.NO_AUTOCAST_INSIDE):
                return flex_attention_forward(module, q, k, v, mask, scaling=dim ** -0.5, s_aux=sinks,
                                              kernel_options=kernel_options)[0]

        def forward_backward(forward=forward):
            forward().backward(grad)

        try:
            fwd_nograd = float("nan")
            if s.TIME_NO_GRAD:
                with torch.no_grad():
                    fwd_nograd = timed_ms(forward, s.REPS)
            fwd = timed_ms(forward, s.REPS)
            both = timed_ms(forward_backward, s.REPS)
            rows.append((options, name, fwd_nograd, fwd, both))
        except Exception as err:  # a kernel option the compiler refuses is a result, not a crash
            rows.append((options, name, float("nan"), float("nan"), float("nan")))
            print(f"{options} {name}: {type(err).__name__}: {str(err)[:200]}")
        print(rows[-1], flush=True)

    for options in s.KERNEL_OPTIONS:
        for name, mask in masks.items():
            measure(options, name, mask)
    if s.COMBINE_BEST:
        for name, mask in masks.items():
            done = [r for r in rows if r[1] == name and not math.isnan(r[4])]  # failed entries out
            if not done:
                continue
            best_fwd = min(done, key=lambda r: r[3])[0]
            best_bwd = min(done, key=lambda r: r[4] - r[3])[0]
            measure(joined([only(best_fwd, "fwd_"), only(best_bwd, "bwd_")]), name, mask)
    qs, ks, vs = q.detach().requires_grad_(), k.detach().requires_grad_(), v.detach().requires_grad_()

    def sdpa():
        return torch.nn.functional.scaled_dot_product_attention(qs, ks, vs, is_causal=True, enable_gqa=True)

    with torch.no_grad():
        sdpa_fwd = timed_ms(sdpa, s.REPS)
    sdpa_both = timed_ms(lambda: sdpa().backward(grad.transpose(1, 2)), s.REPS)
    causal_tflop = 4 * s.ROWS * heads * s.LENGTH ** 2 * dim / 2 / 1e12
    print(f"\n{s.ROWS} rows x {s.LENGTH} tokens, {heads} query / {kv_heads} key-value heads of {dim}; a causal forward "
          f"is {causal_tflop:.2f} TFLOP; {s.WARM_LENGTHS} other lengths first, DYNAMIC={s.DYNAMIC}, "
          f"AUTOCAST={s.AUTOCAST}, NO_AUTOCAST_INSIDE={s.NO_AUTOCAST_INSIDE}")
    print(f"{'kernel_options':<62}{'layer':>8}{'fwd no_grad ms':>15}{'fwd ms':>8}{'fwd+bwd ms':>11}")
    for options, name, fwd_nograd, fwd, both in rows:
        print(f"{options:<62}{name:>8}{fwd_nograd:>15.2f}{fwd:>8.2f}{both:>11.2f}")
    print(f"{'SDPA (flash, causal, no sinks: reference only)':<62}{'full':>8}{sdpa_fwd:>15.2f}{'':>8}"
          f"{sdpa_both:>11.2f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
