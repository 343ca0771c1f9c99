"""One gpt-oss-20b MoE layer at decode sizes: the MXFP4 experts kernel (tes_grpo/experts/mxfp4_decode.py) against
transformers' bf16 grouped_mm, on one GPU. Run on the GPU machine (the numbers go to BENCHMARKS.md):

    python benchmarks/bench_mxfp4_decode.py
    python benchmarks/bench_mxfp4_decode.py --TOKENS=64 --SWEEP=1      # also try other tile sizes at 64 tokens
    python benchmarks/bench_mxfp4_decode.py --TOKENS=64 --REPS=30 --SWEEP=1 --SWEEP_LIST=variants  # kernel variants

It builds one MLP (router + 32 experts) at the 20B shapes with random MXFP4 expert weights (as the checkpoint's,
loaded dequantized), then:
- checks the kernel against transformers' own MLP on the same bf16 weights: the share of outputs bit-equal and the
  largest difference (the sums inside a dot product run in another order, nothing else differs);
- times one layer's MLP per token count, each replayed as a CUDA graph (as graph_decode replays a decode step):
  transformers' grouped_mm experts against the MXFP4 kernel, with the weight bytes each read per microsecond;
- times the same with the routed rows sorted by expert in one Triton program (moe_routing.py) instead of torch's
  sort, searchsorted and division (moe_forward's routing "triton"), and with the router's top-k taken in that
  program too (routing "fused", what a decode step runs), and checks each output is the same;
- SWEEP: the kernel's time for each tile configuration in SWEEP_CONFIGS at the first token count, fastest first,
  each with whether its output is bit-equal to the default tiles' and its largest difference to transformers' MLP.
  An entry is [VARIANT:]BLOCK_N/BLOCK_K/num_warps/num_stages[/BLOCK_M] (sweep_tiles); VARIANT is default
  (mxfp4_decode.TILES: the Hopper layout the experts are kept in, whose loaded bytes are the MMA's operand
  registers, unpacked by OpenAI triton_kernels' PTX), hopper-bitops (the same unpacked by Triton's bit operations,
  as on GPUs before Hopper), dot_scaled (tl.dot_scaled upcasts), bits (the kernel's own upcast, then tl.dot) or
  bits-swap (that, the weights as the dot's left operand); the last three read tile order.
  An entry whose layout, tile or warps differ from the stored ones (the Hopper layout at mxfp4.TILE, 4 warps) reads
  a copy of the weights in its own.
  SWEEP_LIST=variants sweeps _VARIANT_SWEEP (the variants at their best measured shapes) by default instead.
"""

from __future__ import annotations

import sys as _sys
from pathlib import Path as _Path

_sys.path.insert(0, str(_Path(__file__).resolve().parents[1]))

import sys

from tes_grpo.run.script_config import resolve

TOKENS = (16, 64, 128, 256)  # tokens per decode step (= sequences decoded together)
REPS = 50  # graph replays timed per measurement
SWEEP = False  # also time the kernel for each tile configuration (first token count)
# [VARIANT:]BLOCK_N/BLOCK_K/num_warps/num_stages[/BLOCK_M] tried by SWEEP (on the command line:
# --SWEEP_CONFIGS=128/128/4/3,dot_scaled:64/256/4/3/8); other layouts, tiles or warps than the stored read a copy
SWEEP_CONFIGS = ("128/128/4/4", "128/128/4/3", "128/128/4/2", "128/128/4/5", "128/128/4/4/32", "128/256/4/4",
                 "256/128/8/4", "256/128/8/3")
SWEEP_LIST = "tiles"  # "variants": SWEEP_CONFIGS defaults to _VARIANT_SWEEP (the kernel variants)
# each variant at the shape the earlier sweeps found fastest for it (BENCHMARKS.md)
_VARIANT_SWEEP = ("128/128/4/4", "hopper-bitops:128/128/4/4", "bits-swap:128/128/4/3/16",
                  "bits-swap:128/128/4/3/8", "bits:128/128/4/3", "dot_scaled:128/128/4/3", "dot_scaled:64/128/4/3")
PRESETS = {"SWEEP_LIST": {"variants": {"SWEEP_CONFIGS": _VARIANT_SWEEP}}}
CHOICES = {"SWEEP_LIST": ("tiles", "variants")}
SEED = 0  # torch seed


def one_layer(seed: int):
    import torch
    from transformers.models.gpt_oss.modeling_gpt_oss import GptOssMLP

    from tes_grpo.model.gpt_oss_shapes import gpt_oss_20b_config, random_mxfp4_experts

    config = gpt_oss_20b_config()
    config._experts_implementation = "grouped_mm"
    torch.manual_seed(seed)
    with torch.device("cuda"):
        mlp = GptOssMLP(config).to(torch.bfloat16)
    with torch.no_grad():
        for param in mlp.parameters():
            param.normal_(0.0, 0.02)
    random_mxfp4_experts(mlp, seed)
    return mlp.requires_grad_(False).eval()


def graph_time(fn, reps: int) -> float:
    """Microseconds per call of fn() replayed as a CUDA graph."""
    import torch

    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        fn()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fn()
    graph.replay()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(reps):
        graph.replay()
    end.record()
    torch.cuda.synchronize()
    return 1000 * start.elapsed_time(end) / reps


SWEEP_VARIANTS = {"default": {}, "hopper-bitops": {"upcast": "hopper", "ptx": False},
                  "dot_scaled": {"upcast": "dot_scaled", "swap": False},
                  "bits": {"upcast": "bits", "swap": False},
                  "bits-swap": {"upcast": "bits", "swap": True}}  # VARIANT: prefix -> Tiles fields


def sweep_tiles(config: str) -> dict:
    """A SWEEP_CONFIGS entry ("64/128/4/3", "bits-swap:64/128/4/3/8") -> the mxfp4_decode.Tiles fields it sets
    (block_m only where given); ValueError names the entry and the syntax otherwise."""
    syntax = (f"SWEEP_CONFIGS: {config!r} is not [VARIANT:]BLOCK_N/BLOCK_K/num_warps/num_stages[/BLOCK_M] (whole "
              f"numbers; VARIANT one of {', '.join(SWEEP_VARIANTS)})")
    variant, colon, numbers = config.rpartition(":")
    variant = variant if colon else "default"
    values = numbers.split("/")
    if variant not in SWEEP_VARIANTS or len(values) not in (4, 5) or not all(v.strip().isdigit() for v in values):
        raise ValueError(syntax)
    names = ("block_n", "block_k", "num_warps", "num_stages", "block_m")
    return {**SWEEP_VARIANTS[variant], **dict(zip(names, (int(v) for v in values), strict=False))}


def main(argv: list[str] | None = None) -> int:
    s = resolve(globals(), argv, presets=PRESETS, choices=CHOICES)
    try:
        configs = {config: sweep_tiles(config) for config in s.SWEEP_CONFIGS}
    except ValueError as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    import torch

    from benchmarks.log_header import header
    from tes_grpo.experts import mxfp4_decode
    from tes_grpo.experts.moe_routing import MAX_ROWS as route_limit

    try:  # each entry's Tiles (their own checks) before the GPU work
        sweep_tiles_of = {config: mxfp4_decode.Tiles(**fields) for config, fields in configs.items()}
    except ValueError as err:
        print(f"error: SWEEP_CONFIGS: {err}", file=sys.stderr)
        return 2
    print(header(), flush=True)
    mlp = one_layer(s.SEED)
    packed = mxfp4_decode.pack_experts(mlp.experts)
    bf16_bytes = sum(p.numel() * p.element_size() for p in (mlp.experts.gate_up_proj, mlp.experts.down_proj))
    mxfp4_bytes = packed.nbytes()
    rows = []
    for tokens in s.TOKENS:
        x = torch.randn(tokens, 1, mlp.router.hidden_dim, device="cuda", dtype=torch.bfloat16)
        with torch.no_grad():
            ref = mlp(x)[0]
            ours = mxfp4_decode.moe_forward(mlp, packed, x, routing="torch")
            equal = (ours == ref).float().mean().item()
            diff = (ours.float() - ref.float()).abs().max().item()
            t_ref = graph_time(lambda x=x: mlp(x), s.REPS)
            t_ours = graph_time(lambda x=x: mxfp4_decode.moe_forward(mlp, packed, x, routing="torch"), s.REPS)
            # the rows sorted by expert in one Triton program instead of torch's sort, searchsorted and division
            if tokens * mlp.router.top_k <= route_limit:
                routed = mxfp4_decode.moe_forward(mlp, packed, x, routing="triton")
                t_routed = graph_time(lambda x=x: mxfp4_decode.moe_forward(mlp, packed, x, routing="triton"), s.REPS)
                fused = mxfp4_decode.moe_forward(mlp, packed, x, routing="fused")
                t_fused = graph_time(lambda x=x: mxfp4_decode.moe_forward(mlp, packed, x, routing="fused"), s.REPS)
                routed_same = f"{torch.equal(routed, ours)}/{torch.equal(fused, ours)}"
            else:
                t_routed, t_fused, routed_same = float("nan"), float("nan"), "n/a (over MAX_ROWS)"
        rows.append((tokens, equal, diff, t_ref, t_ours, t_routed, t_fused, routed_same))
        print(f"{tokens} tokens: bit-equal {100 * equal:.2f}%, max |diff| {diff:.2e}, grouped_mm {t_ref:.0f} us, "
              f"mxfp4 {t_ours:.0f} us, with Triton routing {t_routed:.0f} us, with the fused top-k and routing "
              f"{t_fused:.0f} us (same output: {routed_same})", flush=True)
    sweep = []
    if s.SWEEP:
        x = torch.randn(s.TOKENS[0], 1, mlp.router.hidden_dim, device="cuda", dtype=torch.bfloat16)
        # torch's routing, as the table's mxfp4 column: the sweep varies the experts kernel alone
        with torch.no_grad():
            ref = mlp(x)[0].float()
            default = mxfp4_decode.moe_forward(mlp, packed, x, routing="torch")
        for config, tiles in sweep_tiles_of.items():
            try:
                pack = mxfp4_decode.retiled(packed, tiles)  # a copy where its layout is not the stored one
                with torch.no_grad():
                    out = mxfp4_decode.moe_forward(mlp, pack, x, routing="torch")
                    # another K tile sums in another order: equal up to bf16 rounding, not always bit for bit
                    ok = (f"bit-equal to the default tiles: {torch.equal(default, out)}, max |diff| to "
                          f"transformers' MLP {(out.float() - ref).abs().max().item():.1e}")
                    t = graph_time(lambda pack=pack: mxfp4_decode.moe_forward(mlp, pack, x, routing="torch"), s.REPS)
                del pack
                sweep.append((config, t, ok))
            except Exception as err:  # a tile size the compiler refuses is a result, not a crash
                sweep.append((config, float("nan"), f"{type(err).__name__}: {str(err)[:80]}"))
            print(f"sweep {config}: {sweep[-1][1]:.0f} us ({sweep[-1][2]})", flush=True)
    print(f"\none MoE layer (router + 32 experts, 20B shapes); expert weights read: bf16 {bf16_bytes / 1e6:.0f} MB, "
          f"MXFP4 {mxfp4_bytes / 1e6:.0f} MB; tiles {mxfp4_decode.TILES}")
    print(f"{'tokens':>7}{'bit-equal':>11}{'max diff':>10}{'grouped_mm us':>15}{'mxfp4 us':>10}{'speed-up':>9}"
          f"{'bf16 GB/s':>11}{'mxfp4 GB/s':>12}{'Triton routing us':>19}{'fused routing us':>18}  same output "
          f"(Triton/fused)")
    for tokens, equal, diff, t_ref, t_ours, t_routed, t_fused, routed_same in rows:
        print(f"{tokens:>7}{100 * equal:>10.2f}%{diff:>10.1e}{t_ref:>15.0f}{t_ours:>10.0f}{t_ref / t_ours:>8.2f}x"
              f"{bf16_bytes / t_ref / 1e3:>11.0f}{mxfp4_bytes / t_ours / 1e3:>12.0f}{t_routed:>19.0f}{t_fused:>18.0f}"
              f"  {routed_same}")
    for config, t, ok in sorted(sweep, key=lambda row: (row[1] != row[1], row[1])):  # fastest first, failures last
        print(f"tiles [variant:]N/K/warps/stages[/M] {config:>24}: {t:>5.0f} us, "
              f"{mxfp4_bytes / t / 1e3:>5.0f} GB/s ({ok})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
