"""The benchmarks' FLOP accounting, against a count of the attention masks themselves, and their report of what
torch.compile spent (CPU, no model)."""

from types import SimpleNamespace

import pytest
import torch

from benchmarks.grpo_timers import attention_gflop_per_row


def counted_by_mask(length: int, config) -> float:
    """GFLOP from the dense masks: 4 forwards' worth of 2 matmuls of 2 FLOP per attended (query, key) pair."""
    q = torch.arange(length)[:, None]
    kv = torch.arange(length)[None, :]
    pairs = 0
    for kind in config.layer_types:
        allowed = kv <= q
        if kind == "sliding_attention":
            allowed &= q - kv < config.sliding_window  # transformers' sliding_window_overlay
        pairs += int(allowed.sum())
    return 4 * 2 * 2 * config.num_attention_heads * config.head_dim * pairs / 1e9


def config(layer_types, window=4, heads=3, head_dim=8):
    return SimpleNamespace(layer_types=layer_types, sliding_window=window, num_attention_heads=heads,
                           head_dim=head_dim)


SLIDING_FULL = ["sliding_attention", "full_attention"]
# (length, layer types, window)
CASES = [
    (1, SLIDING_FULL, 4),  # one token attends to itself only
    (3, SLIDING_FULL, 4),  # shorter than the window: sliding layers are causal
    (4, SLIDING_FULL, 4),  # exactly the window
    (11, SLIDING_FULL, 4),  # past the window: sliding rows stop growing
    (11, ["full_attention"] * 3, 4),  # full layers only
    (37, ["sliding_attention"] * 2 + ["full_attention"], 16),  # gpt-oss's pattern, uneven counts
]


@pytest.mark.parametrize("length, layer_types, window", CASES)
def test_attention_gflop_counts_the_masked_pairs(length, layer_types, window):
    c = config(layer_types, window)
    assert attention_gflop_per_row(length, c) == pytest.approx(counted_by_mask(length, c), rel=1e-12)


def test_attention_share_at_the_recipe():
    # gpt-oss-20b: 24 layers alternating sliding (128) and full, 64 heads of 64; a 4,871-token row (841-token
    # prompt + 4,000): attention is ~9 % on top of 22 GFLOP a token, ~1 % at 256-token completions
    c = config(["sliding_attention", "full_attention"] * 12, window=128, heads=64, head_dim=64)
    assert attention_gflop_per_row(4871, c) / (22.0 * 4871) == pytest.approx(0.091, abs=0.002)
    assert attention_gflop_per_row(841 + 256, c) / (22.0 * (841 + 256)) < 0.025


# (true scale of the derived activations, true fixed GiB, fused cases measured; expected fit or None)
CALIBRATIONS = [
    (1.00, 0.0, 4, (1.00, 0.0, 1.00)),  # the estimate is exact
    (1.20, 0.0, 4, (1.20, 0.0, 1.20)),  # 20 % more per token than derived: ACTIVATION_SCALE 1.2
    (1.00, 0.5, 4, None),  # a fixed 0.5 GiB: through the origin the scale absorbs it, the free fit finds it
    (1.00, 0.0, 1, None),  # one point cannot calibrate
]


@pytest.mark.parametrize("scale, fixed, points, expected", CALIBRATIONS)
def test_memory_calibration_recovers_the_scale(scale, fixed, points, expected):
    from benchmarks.bench_memory import calibration

    gib = 2**30
    rows = [{"head": "fused", "derived_activation_bytes": a * gib, "head_bytes": gib // 4,
             "peak_bytes": int((scale * a + fixed) * gib) + gib // 4} for a in (2.0, 4.0, 8.0, 16.0)[:points]]
    rows.append({"head": "full", "derived_activation_bytes": gib, "head_bytes": 9 * gib, "peak_bytes": 99 * gib})
    rows.append({"head": "fused", "derived_activation_bytes": gib, "head_bytes": 0, "peak_bytes": None})  # OOM
    fit = calibration(rows)
    if points < 2:
        assert fit is None
    elif expected is not None:
        assert fit == pytest.approx(expected, abs=1e-6)
    else:
        through_origin, fitted_fixed, slope = fit
        assert through_origin > scale and fitted_fixed == pytest.approx(fixed) and slope == pytest.approx(scale)


def rows(*steps):
    """bench rows from (step seconds, generated) pairs, steps numbered from 1."""
    return [{"step": i, "step_s": s, "generated": g} for i, (s, g) in enumerate(steps, 1)]


# (rows, the groups generation_cycles makes: first step, last step, steps, mean step seconds)
CYCLES = [
    (rows((50.0, True), (40.0, True)), [(1, 1, 1, 50.0), (2, 2, 1, 40.0)]),  # GENERATION_STEPS=1: every step its own
    (rows((90.0, True), (10.0, False), (70.0, True), (10.0, False)),
     [(1, 2, 2, 50.0), (3, 4, 2, 40.0)]),  # 2: the generating step and the one that reuses its batch
    (rows((130.0, True), (10.0, False), (10.0, False), (10.0, False)), [(1, 4, 4, 40.0)]),  # 4, one batch
]


@pytest.mark.parametrize("timed, expected", CYCLES)
def test_generation_cycles_average_each_batchs_steps(timed, expected):
    from benchmarks.grpo_timers import generation_cycles

    assert [(c["first"], c["last"], c["steps"], c["mean_step_s"]) for c in generation_cycles(timed)] == expected


DOT_SCALED = {"upcast": "dot_scaled", "swap": False}
# (SWEEP_CONFIGS entry, the Tiles fields it sets, or None where it is refused)
SWEEP_ENTRIES = [
    ("128/128/4/3", {"block_n": 128, "block_k": 128, "num_warps": 4, "num_stages": 3}),  # the default variant
    ("128/256/8/4", {"block_n": 128, "block_k": 256, "num_warps": 8, "num_stages": 4}),  # other numbers
    ("dot_scaled:64/128/4/3/32",
     {**DOT_SCALED, "block_n": 64, "block_k": 128, "num_warps": 4, "num_stages": 3, "block_m": 32}),  # named, BLOCK_M
    ("bits:64/256/4/2", {"upcast": "bits", "swap": False, "block_n": 64, "block_k": 256, "num_warps": 4,
                         "num_stages": 2}),
    ("bits-swap:128/128/8/3/8", {"upcast": "bits", "swap": True, "block_n": 128, "block_k": 128, "num_warps": 8,
                                 "num_stages": 3, "block_m": 8}),
    ("hopper-bitops:128/128/4/4", {"upcast": "hopper", "ptx": False, "block_n": 128, "block_k": 128,
                                   "num_warps": 4, "num_stages": 4}),  # the unpacking GPUs before Hopper run
    ("tiled:64/128/4/3", None),  # gone: a variant names its upcast, which names the layout it reads
    ("128/64/4", None),  # three numbers
    ("bits-swap:128/64/4/3/8/2", None),  # six
    ("128/64/4/a", None),  # not a number
    ("wx:128/64/4/3", None),  # an unknown variant
    ("bits:swap:128/64/4/3", None),  # two prefixes
    (":128/64/4/3", None),  # an empty one
]


@pytest.mark.parametrize("entry, fields", SWEEP_ENTRIES)
def test_mxfp4_sweep_entries(entry, fields):
    from benchmarks.bench_mxfp4_decode import sweep_tiles

    if fields is None:
        with pytest.raises(ValueError, match="SWEEP_CONFIGS"):
            sweep_tiles(entry)
    else:
        assert sweep_tiles(entry) == fields


def test_mxfp4_variant_sweep_list_parses_and_covers_every_variant():
    """SWEEP_LIST=variants' entries (checked here, not first on the GPU machine) name every kernel variant, and both
    token-tile heights where the weights are the left operand."""
    from benchmarks.bench_mxfp4_decode import _VARIANT_SWEEP, SWEEP_VARIANTS, sweep_tiles
    from tes_grpo.experts.mxfp4_decode import Tiles

    tiles = [Tiles(**sweep_tiles(entry)) for entry in _VARIANT_SWEEP]
    assert {(t.upcast, t.swap, t.ptx) for t in tiles} == {(t.upcast, t.swap, t.ptx) for t in
                                                           (Tiles(**v) for v in SWEEP_VARIANTS.values())}
    assert {t.block_m for t in tiles if t.swap} == {8, 16}
    assert len(set(_VARIANT_SWEEP)) == len(_VARIANT_SWEEP)


# (FLEX entry of bench_decode_attention.py, the flex attention kernel options it sets, or None where it is refused)
FLEX_ENTRIES = [
    ("0", {}),  # flex attention's own choices
    ("8", {"SPLIT_KV": 8}),  # the keys of each sequence and key-value head in 8 parts
    ("8/128", {"SPLIT_KV": 8, "BLOCK_N": 128}),
    ("0/32/4/2", {"BLOCK_N": 32, "num_warps": 4, "num_stages": 2}),  # flex's own split, the rest given
    ("8/128/4", None),  # three numbers
    ("8/x", None),  # not a number
    ("", None),  # empty
]


@pytest.mark.parametrize("entry, options", FLEX_ENTRIES)
def test_decode_attention_flex_entries(entry, options):
    from benchmarks.bench_decode_attention import flex_options

    if options is None:
        with pytest.raises(ValueError, match="FLEX"):
            flex_options(entry)
    else:
        assert flex_options(entry) == options


# (TRITON entry of bench_decode_attention.py, the tiles it gives decode_attention.attention, or None where refused)
TRITON_ENTRIES = [
    ("64/4/3", (64, 4, 3)),  # the kernel's default
    ("128/8/2", (128, 8, 2)),
    ("64/4", None),  # two numbers
    ("64/0/3", None),  # no warps
    ("64/x/3", None),  # not a number
]


@pytest.mark.parametrize("entry, tiles", TRITON_ENTRIES)
def test_decode_attention_triton_entries(entry, tiles):
    from benchmarks.bench_decode_attention import triton_tiles

    if tiles is None:
        with pytest.raises(ValueError, match="TRITON"):
            triton_tiles(entry)
    else:
        assert triton_tiles(entry) == tiles


def _compiled(name, seconds, file="/x/decode_glue.py", line=38):
    return SimpleNamespace(co_name=name, co_filename=file, co_firstlineno=line, entire_frame_compile_time_s=seconds,
                           start_time_us=None, end_time_us=None, backward_cumulative_compile_time_us=None)


def _backward(start_us, end_us):
    return SimpleNamespace(co_name=None, co_filename=None, co_firstlineno=None, entire_frame_compile_time_s=None,
                           start_time_us=start_us, end_time_us=end_us, backward_cumulative_compile_time_us=1)


@pytest.mark.parametrize("records, expected", [
    ([], ["torch.compile in this process: nothing compiled"]),
    # two graphs of one function (two shapes) add up, the longest function first; a backward graph has no code
    # object and is timed from its start and end
    ([_compiled("rms_norm", 2.0), _compiled("flex_attention", 9.5, "/t/flex_attention.py", 1290),
      _compiled("rms_norm", 1.5), _backward(1_000_000, 4_250_000)],
     ["torch.compile in this process: 4 graphs, 16.2 s (dynamo, AOT autograd, inductor and the Triton compiles it "
      "waited for); the longest:",
      "      9.5 s    1 x  flex_attention (flex_attention.py:1290)",
      "      3.5 s    2 x  rms_norm (decode_glue.py:38)",
      "      3.2 s    1 x  (backward graphs, each compiled at its first backward)"]),
])
def test_compilation_lines(records, expected):
    from benchmarks.timing import compilation_lines

    assert compilation_lines(records) == expected


def test_compilation_lines_keep_the_longest():
    from benchmarks.timing import compilation_lines

    lines = compilation_lines([_compiled(f"f{i}", float(i), line=i) for i in range(12)], top=3)
    assert len(lines) == 4 and [line.split()[-2] for line in lines[1:]] == ["f11", "f10", "f9"]


@pytest.mark.parametrize("kernel, group", [
    ("triton_tem_fused_flex_attention_backward_mul_1", "attention backward"),  # flex's backward before its forward
    ("triton_tem_fused_flex_attention_0", "attention forward"),
    ("_ZN7cutlass13device_kernelIN2at4cuda6detail25enable_3x_kernel_for_sm9xINS_4gemm6kernel", "matrix products"),
    ("nvjet_sm90_tst_256x144_64x4_1x2_h_bz_coopA_bias_TNT", "matrix products"),  # cuBLAS's Hopper kernels
    ("Memcpy DtoD (Device -> Device)", "copies and casts"),  # matched without case
    ("void at::native::vectorized_elementwise_kernel<8, at::native::bfloat16_copy_kernel_cuda", "copies and casts"),
    ("triton_poi_fused_add_mul_0", "compiled or Triton kernels"),
    ("void at::native::vectorized_elementwise_kernel<8, at::native::CUDAFunctor_add<c10::BFloat16>",
     "eager elementwise and reductions"),
    ("ncclDevKernel_AllReduce", "other"),
])
def test_kernel_group(kernel, group):
    from benchmarks.bench_grpo import kernel_group

    assert kernel_group(kernel) == group


@pytest.mark.parametrize("shape, expected", [
    ("8x4869", (8, 4869)),  # rows x tokens
    ("8 x 4869", None),  # spaces: not a whole number
    ("8x", None),  # no token count
    ("0x128", None),  # no rows
    ("8by4869", None),  # no separator
])
def test_block_mask_shapes(shape, expected):
    from benchmarks.bench_block_mask import parse_shape

    if expected is None:
        with pytest.raises(SystemExit, match=f"SHAPES entry '{shape}'"):
            parse_shape(shape)
    else:
        assert parse_shape(shape) == expected


@pytest.mark.parametrize("ways, bad", [
    (("compiled", "eager", "bounds"), None),  # the default
    (("eager", "bounds"), None),
    (("compiled", "bound"), "bound"),  # a misspelt way: an error, not a run of the compiled way under its name
])
def test_block_mask_ways(ways, bad):
    from benchmarks.bench_block_mask import check_ways

    if bad is None:
        assert check_ways(ways) == ways
    else:
        with pytest.raises(SystemExit, match=f"WAYS entry '{bad}'"):
            check_ways(ways)
