"""mxfp4_decode.py: the MXFP4 experts kernel gives transformers' bf16 MLP output bit for bit, packs only weights that
are exactly MXFP4, and graph_decode samples the same tokens with it as with the model's own experts.

The Triton kernels run under Triton's interpreter on the CPU (TRITON_INTERPRET=1 while the module is imported): the
same kernel code the GPU compiles, with the same bf16 roundings (the module rounds on the bits because the
interpreter's own float-to-bf16 conversion truncates). On a GPU the sums inside a dot product may run in another
order; benchmarks/bench_mxfp4_decode.py measures that there.
"""

import importlib

import pytest
import torch
from transformers import GenerationConfig, GptOssConfig, GptOssForCausalLM
from transformers.models.gpt_oss.modeling_gpt_oss import GptOssMLP
from triton_interpreter import interpreted
from versions import older_than

from tes_grpo.experts.mxfp4 import fake_quantize_expert_param
from tes_grpo.triton_support import module_interpreted

pytest.importorskip("triton", reason="requirements-test.txt installs triton (its interpreter runs these on CPU)")
pytestmark = pytest.mark.usefixtures("one_torch_thread")


def interpreter_runs_the_kernel() -> bool:
    """Triton before 3.7 converts a loaded scalar with int() on a 1-element array, which NumPy 2.4 refuses
    (triton-lang/triton#9171): the kernel's `range(start, end, ...)` over rows then fails under the interpreter."""
    return not older_than("triton", "3.7") or older_than("numpy", "2.4")


runs_kernel = pytest.mark.skipif(
    not interpreter_runs_the_kernel(),
    reason="Triton < 3.7's interpreter cannot run this kernel under NumPy >= 2.4 (triton-lang/triton#9171); the "
           "compiled kernel is checked against transformers' MLP on CUDA in tests/gpu_cuda_test.py")


def interpreter_has_bf16_constants() -> bool:
    """Triton 3.6's interpreter builds no bf16 constant (its InterpreterBuilder lacks get_bf16), which the bits
    upcast's bf16 multiplies by a constant need; 3.9's has it."""
    from triton.runtime.interpreter import InterpreterBuilder

    return hasattr(InterpreterBuilder, "get_bf16")


bf16_constants = pytest.mark.skipif(
    not interpreter_has_bf16_constants(),
    reason="this Triton's interpreter builds no bf16 constant (InterpreterBuilder.get_bf16, absent in 3.6); the "
           "compiled bits upcast is checked against the codec bit for bit on CUDA in tests/gpu_cuda_test.py")


@pytest.fixture(scope="module", autouse=True)
def triton_interpreter():
    """tes_grpo.experts.mxfp4_decode with its kernels (tes_grpo.experts.mxfp4_kernels) under Triton's interpreter for
    this module's tests."""
    global md
    with interpreted("tes_grpo.experts.mxfp4_kernels"):
        md = importlib.import_module("tes_grpo.experts.mxfp4_decode")
        assert module_interpreted(md.mxfp4_kernels)
        yield


md = None  # tes_grpo.experts.mxfp4_decode, set by triton_interpreter


def mlp_config(hidden=96, inter=160, experts=8, top_k=4) -> GptOssConfig:
    config = GptOssConfig(hidden_size=hidden, intermediate_size=inter, num_local_experts=experts,
                          num_experts_per_tok=top_k)
    config._experts_implementation = "grouped_mm"
    return config


def mxfp4_exact(module) -> None:
    """Expert weights as loaded from an MXFP4 checkpoint (dequantized: exactly representable)."""
    with torch.no_grad():
        for experts in (m for m in module.modules() if type(m).__name__ == "GptOssExperts"):
            experts.gate_up_proj.copy_(fake_quantize_expert_param(experts.gate_up_proj))
            experts.down_proj.copy_(fake_quantize_expert_param(experts.down_proj))


def random_mlp(seed=0, **shape) -> GptOssMLP:
    torch.manual_seed(seed)
    mlp = GptOssMLP(mlp_config(**shape))
    with torch.no_grad():
        for name, param in mlp.named_parameters():
            param.normal_(0.0, 0.5 if "bias" in name else 0.1)
    mlp = mlp.to(torch.bfloat16)
    mxfp4_exact(mlp)
    return mlp.requires_grad_(False)


# Tiles fields of each kernel variant (mxfp4_decode.Tiles): the default (the Hopper layout the experts are kept in,
# its bit unpacking, the weights as the dot's left operand, 16 rows a tile), the bits upcast on a tile-order copy
# with 16 or 8 rows or without the swap, Triton's tl.dot_scaled upcast, and copies at other tiles (retiled)
VARIANTS = {
    "hopper": {},
    "hopper-wide-k": {"block_k": 256},  # a copy in the Hopper layout padded to 256 inputs
    "hopper-8-warps": {"block_n": 256, "num_warps": 8},  # a copy whose scales are laid out for 8 warps
    "bits-swap-16": {"upcast": "bits"},
    "bits-swap-8": {"upcast": "bits", "block_m": 8},
    "bits": {"upcast": "bits", "swap": False},
    "dot_scaled": {"upcast": "dot_scaled", "swap": False},  # DOT_SCALED: where the bits upcasts are not exact
    "narrow-tiles": {"upcast": "bits", "block_n": 64, "block_k": 64},  # a copy in another tile order
}


@pytest.mark.parametrize("variant", VARIANTS)
@pytest.mark.parametrize("tokens, shape", [
    (1, {}),  # one decode token: 4 of 8 experts get a row, the others none (their programs do nothing)
    (37, {}),  # 148 rows over 8 experts: several 16-row tiles per expert
    (5, {"hidden": 64, "inter": 64, "experts": 4, "top_k": 2}),  # K = 64, less than one 128-wide K tile
    (16, {"hidden": 160, "inter": 96, "experts": 32, "top_k": 4}),  # K = 160: a partial last K tile; 32 experts
])
@runs_kernel
def test_kernel_equals_transformers_mlp_bit_for_bit(tokens, shape, variant):
    """Both launches (gate_up with SwiGLU, down with the routed output) of every kernel variant."""
    mlp = random_mlp(**shape)
    x = torch.randn(1, tokens, mlp.router.hidden_dim).to(torch.bfloat16)
    tiles = md.Tiles(**VARIANTS[variant])
    # oneDNN's bf16 matmuls on CPUs with AMX (Sapphire Rapids and later) round differently from every other CPU
    # path (torch 2.13: equal with ONEDNN_MAX_CPU_ISA=AVX512_CORE, not with AMX); ATen's own kernels give the same
    # sums on any x86 CPU, so the reference (and the router both sides share) runs there
    with torch.backends.mkldnn.flags(enabled=False):
        ours = md.moe_forward(mlp, md.retiled(md.pack_experts(mlp.experts), tiles), x)
        reference = mlp(x)[0]
    assert torch.equal(ours, reference)


@pytest.mark.parametrize("block_n, block_k", [
    (32, 64),  # narrower tiles than the stored ones: a copy in that tile order
    (128, 256),  # wider than the matrices (one tile, mostly padding)
])
@runs_kernel
def test_other_tile_sizes_give_the_same_result(block_n, block_k):
    tiles = md.Tiles(block_n=block_n, block_k=block_k, upcast="bits")
    mlp = random_mlp(seed=1)
    x = torch.randn(9, mlp.router.hidden_dim).to(torch.bfloat16)
    packed = md.pack_experts(mlp.experts)
    other = md.retiled(packed, tiles)
    assert packed.tile == md.TILE and other.tile == (block_n, block_k) and not other.resident
    _, scores, ids = mlp.router(x)
    order = torch.sort(ids.reshape(-1), stable=True)[1]
    offsets = torch.searchsorted(ids.reshape(-1)[order], torch.arange(9))
    rows = torch.div(order, ids.shape[1], rounding_mode="floor")
    default = md.experts_matmul(x, rows, offsets, packed.gate_up_blocks, packed.gate_up_scales, packed.gate_up_size,
                                packed.gate_up_bias)
    ours = md.experts_matmul(x, rows, offsets, other.gate_up_blocks, other.gate_up_scales, other.gate_up_size,
                             other.gate_up_bias, tiles=tiles)
    assert torch.equal(default, ours)


# every (low, high) pair of FP4 codes in a row's 256 bytes; scales across the range the upcast is exact for
UPCAST_SCALES = (1, 2, 50, 100, 110, 118, 121, 125, 126, 127, 128, 129, 135, 160, 220, 254)


@bf16_constants
def test_bits_upcast_equals_the_codec():
    """Tiles.upcast="bits"'s integer upcast gives dequantize_mxfp4's bf16 values, bit for bit (signed zeros and the
    subnormal code 0.5 included), for all 16 codes in both nibbles times every scale of the table."""
    from tes_grpo.experts.mxfp4 import dequantize_mxfp4

    blocks = torch.arange(256, dtype=torch.uint8).reshape(1, 16, 16).expand(16, 16, 16).contiguous()
    group = torch.arange(16)
    scales = torch.tensor(UPCAST_SCALES, dtype=torch.uint8)[(group[:, None] + group[None, :]) % 16]
    ours = md.upcast_mxfp4(blocks, scales)
    assert torch.equal(ours.view(torch.int16), dequantize_mxfp4(blocks, scales, torch.bfloat16).view(torch.int16))


@bf16_constants
def test_bits_upcast_of_an_all_zero_group_at_scale_0_is_the_codecs():
    # quantize_mxfp4 writes scale 0 for an all-zero group; its codes are +0 (0x0) and -0 (0x8) in either nibble
    from tes_grpo.experts.mxfp4 import dequantize_mxfp4

    blocks = torch.tensor([0x00, 0x08, 0x80, 0x88] * 4, dtype=torch.uint8).reshape(1, 1, 16)
    scales = torch.zeros(1, 1, dtype=torch.uint8)
    ours = md.upcast_mxfp4(blocks, scales)
    assert torch.equal(ours.view(torch.int16), dequantize_mxfp4(blocks, scales, torch.bfloat16).view(torch.int16))


@pytest.mark.parametrize("fields, message", [
    ({"upcast": "fp8"}, "upcast='fp8'; valid: 'dot_scaled', 'bits'"),
    ({"upcast": "dot_scaled"}, "swap=True needs upcast='bits' or 'hopper'"),  # measured slower, gone
    ({"block_n": 64}, "block_n of 32 x num_warps"),  # the Hopper scales' layout: 32 rows a warp
    ({"block_k": 64}, "block_k a multiple of 128"),
    ({"block_m": 8}, "block_m >= 16"),  # measured not bit-equal on the H100
    ({"swap": False}, "needs swap=True"),
])
def test_tiles_refuse_an_unknown_variant(fields, message):
    with pytest.raises(ValueError, match=message):
        md.Tiles(**fields)


# (what one 32-value group holds: its scale byte, its 16 code bytes; whether the bits upcast gives it exactly)
UPCAST_EXACT_CASES = [
    (127, 0x21, True),  # an ordinary group
    (1, 0x77, True),  # the smallest scale it handles
    (254, 0x77, True),  # the largest
    (0, 0x00, True),  # scale 0 on an all-zero group (quantize_mxfp4 writes it): zeros either way
    (0, 0x88, True),  # ... of negative zeros
    (0, 0x01, False),  # scale 0 under a nonzero code: the bits upcast reads 0, the format 0.5 x 2**-127
    (255, 0x00, False),  # 255 (NaN in the format): the bits upcast reads infinities
]


@pytest.mark.parametrize("scale, byte, exact", UPCAST_EXACT_CASES)
def test_upcast_is_exact(scale, byte, exact):
    """The same answer from the checkpoint's layout and tile order, and from a pack in the Hopper layout
    (pack_is_exact); upcast_is_exact refuses the Hopper layout, whose bytes it would pair with the wrong scales."""
    from tes_grpo.experts.mxfp4 import to_hopper_layout, to_tile_order

    blocks = torch.full((2, 64, 4, 16), 0x35, dtype=torch.uint8)
    scales = torch.full((2, 64, 4), 120, dtype=torch.uint8)
    blocks[1, 17, 2] = byte  # one group of one expert
    scales[1, 17, 2] = scale
    tiled = to_tile_order(blocks, "blocks"), to_tile_order(scales, "scales")
    assert md.upcast_is_exact(blocks, scales) is exact and md.upcast_is_exact(*tiled) is exact
    hopper = to_hopper_layout(blocks, "blocks"), to_hopper_layout(scales, "scales")
    pack = md.PackedExperts(*hopper, *hopper, (64, 128), (64, 128), None, None, 1.0, 1.0, ())
    assert md.pack_is_exact(pack) is exact
    with pytest.raises(ValueError, match="in the Hopper layout"):
        md.upcast_is_exact(*hopper)


@runs_kernel
def test_a_layer_the_bits_upcast_cannot_give_exactly_runs_dot_scaled():
    """A group at scale 0 under nonzero codes (values of 2**-128, exactly MXFP4): pack_experts gives the layer
    DOT_SCALED on a tile-order copy, and it still equals transformers' MLP bit for bit."""
    mlp = random_mlp()
    with torch.no_grad():
        mlp.experts.down_proj[2, :32, 5] = 2.0**-128  # one group of 32 inputs of expert 2's output 5
    pack = md.pack_experts(mlp.experts)
    assert pack.tiles == md.DOT_SCALED and md.pack_experts(random_mlp().experts).tiles == md.TILES
    x = torch.randn(1, 9, mlp.router.hidden_dim).to(torch.bfloat16)
    with torch.backends.mkldnn.flags(enabled=False):
        assert torch.equal(md.moe_forward(mlp, pack, x), mlp(x)[0])
    for tiles in (md.TILES, md.Tiles(upcast="bits")):  # asked for another upcast, the layer is refused, not run
        with pytest.raises(ValueError, match="would not give these weights exactly"):
            md.retiled(pack, tiles)
    assert md.retiled(pack, md.Tiles(block_n=64, upcast="dot_scaled", swap=False)).tile == (64, 128)


def test_pack_refuses_weights_that_are_not_exactly_mxfp4():
    mlp = random_mlp()
    with torch.no_grad():
        mlp.experts.down_proj[3, 0, 0] += 1e-3  # one value off the MXFP4 grid
    with pytest.raises(ValueError, match=r"down_proj\[3\] is not exactly MXFP4"):
        md.pack_experts(mlp.experts)


@pytest.mark.parametrize("change, reason", [
    (lambda mlp: mlp.experts.down_proj.requires_grad_(True), "down_proj is trained"),  # a packed copy would go stale
    (lambda mlp: mlp.float(), "is torch.float32"),  # the kernel takes bf16 activations
])
def test_pack_blockers(change, reason):
    mlp = random_mlp()
    change(mlp)
    assert any(reason in r for r in md.pack_blockers(mlp.experts))


def test_pack_is_kept_and_redone_when_the_weights_change_in_place():
    mlp = random_mlp()
    first, fresh = md.packed_experts(mlp.experts)
    assert fresh and isinstance(first, md.PackedExperts)
    assert md.packed_experts(mlp.experts) == (first, False)
    with torch.no_grad():
        mlp.experts.gate_up_proj.mul_(2)  # still exact (a power of two), but new values: the copy must follow
    second, fresh = md.packed_experts(mlp.experts)
    scales = [pack.checkpoint_layout("gate_up")[1] for pack in (first, second)]
    assert fresh and torch.equal(scales[1], scales[0] + 1)


# --- inside graph_decode ---------------------------------------------------------------------------------------

def small_bf16_model(seed=0) -> GptOssForCausalLM:
    config = GptOssConfig(vocab_size=512, hidden_size=64, intermediate_size=64, num_hidden_layers=2,
                          num_attention_heads=4, num_key_value_heads=2, head_dim=16, num_local_experts=4,
                          num_experts_per_tok=2, sliding_window=8, layer_types=["sliding_attention", "full_attention"],
                          pad_token_id=5, eos_token_id=3, bos_token_id=1, attn_implementation="eager")
    config._experts_implementation = "grouped_mm"
    torch.manual_seed(seed)
    model = GptOssForCausalLM(config).to(torch.bfloat16).eval().requires_grad_(False)
    mxfp4_exact(model)
    return model


@runs_kernel
@pytest.mark.slow
def test_graph_decode_samples_the_same_tokens_with_mxfp4_experts():
    from tes_grpo.sampling import graph_decode

    model = small_bf16_model()
    ids = torch.randint(10, 512, (4, 11), generator=torch.Generator().manual_seed(2))
    mask = torch.ones_like(ids)
    mask[2, :4] = 0  # a left-padded row, as TRL pads shorter prompts
    config = GenerationConfig(max_new_tokens=12, do_sample=True, temperature=1.0, top_p=1.0, pad_token_id=5,
                              eos_token_id=[3])
    said = []
    outputs = {}
    for experts in ("model", "mxfp4"):
        torch.manual_seed(7)
        outputs[experts] = graph_decode.generate(model, ids, mask, config, graphs=False, experts=experts,
                                                 say=said.append)
    assert torch.equal(outputs["model"], outputs["mxfp4"])
    assert any("packed 2 layers' experts as MXFP4" in line for line in said)


@runs_kernel
def test_pack_model_with_other_tiles_runs_a_copy_in_their_order():
    """pack_model with tiles whose layout is not the stored one copies each layer's weights into it (said, counted)
    and the packs run with those tiles, equal to transformers' MLP bit for bit; with the stored layout, no copy."""
    model = small_bf16_model()
    stored = md.pack_model(model.model.layers, say=lambda line: None)
    tiles = md.Tiles(block_n=32, block_k=64, upcast="bits")
    said = []
    packs = md.pack_model(model.model.layers, say=said.append, tiles=tiles)
    assert all(pack.tiles == tiles and pack.tile == (32, 64) for pack in packs)
    assert any("2 layers' experts copied in (32, 64) tile order" in line for line in said)
    same = []
    assert md.pack_model(model.model.layers, say=same.append, tiles=md.Tiles(num_stages=2))[0].gate_up_blocks is (
        stored[0].gate_up_blocks) and not same
    x = torch.randn(1, 6, model.config.hidden_size).to(torch.bfloat16)
    mlp = model.model.layers[0].mlp
    with torch.backends.mkldnn.flags(enabled=False):  # ATen's sums, as test_kernel_equals_transformers_mlp's
        reference = mlp(x)[0]
        assert torch.equal(md.moe_forward(mlp, packs[0], x), reference)
        stored[0].gate_up_blocks.zero_()  # the stored order's pack: the copy must not read it
        assert torch.equal(md.moe_forward(mlp, packs[0], x), reference)
        assert not torch.equal(md.moe_forward(mlp, stored[0], x), reference)


def test_the_memory_plan_counts_the_packs_bytes():
    """memory_estimate.expert_bytes(mxfp4=True) against a pack's tensors (the Hopper layout), at a shape whose gate_up
    and down pad differently (hidden 96, intermediate 160: 2 x 160 = 320 -> 384 and 160 -> 256, 96 -> 128)."""
    from dataclasses import replace

    from tes_grpo.model.gpt_oss_shapes import gpt_oss_20b_config
    from tes_grpo.training import memory_estimate

    mlp = random_mlp(hidden=96, inter=160, experts=8)
    pack = md.pack_experts(mlp.experts)
    shape = replace(memory_estimate.ModelShape.from_config(gpt_oss_20b_config()), hidden=96, intermediate=160,
                    experts=8, layers=1)
    assert pack.nbytes() == memory_estimate.expert_bytes(shape, mxfp4=True) == 8 * (384 * 128 + 128 * 256) * 17 // 32


def test_experts_matmul_refuses_weights_in_another_layout():
    mlp = random_mlp()
    pack = md.retiled(md.pack_experts(mlp.experts), md.Tiles(block_n=64, block_k=64, upcast="bits"))
    x = torch.randn(3, mlp.router.hidden_dim).to(torch.bfloat16)
    rows, offsets = torch.arange(3), torch.tensor([0, 3] + [3] * 7)
    with pytest.raises(ValueError, match="retiled makes a copy"):
        md.experts_matmul(x, rows, offsets, pack.gate_up_blocks, pack.gate_up_scales, pack.gate_up_size,
                          pack.gate_up_bias)


@runs_kernel
@pytest.mark.slow
def test_layers_that_cannot_be_packed_decode_with_their_own_experts():
    from benchmarks.decode_compare import decode_logprobs
    from tes_grpo.sampling import decode_math

    model = small_bf16_model()
    with torch.no_grad():
        model.model.layers[1].mlp.experts.gate_up_proj[0, 0, 0] += 1e-3  # a bf16 checkpoint, not MXFP4
    said = []
    packs = decode_math.expert_packs(model, "mxfp4", say=said.append)
    assert isinstance(packs[0], md.PackedExperts) and packs[1] is None
    assert any("layers [1] decode with their bf16 experts" in line and "not exactly MXFP4" in line for line in said)
    ids = torch.randint(10, 512, (2, 9), generator=torch.Generator().manual_seed(3))
    completion = torch.randint(10, 512, (2, 6), generator=torch.Generator().manual_seed(4))
    mask = torch.ones_like(ids)
    ours = decode_logprobs(model, ids, mask, completion, graphs=False, experts="mxfp4")
    theirs = decode_logprobs(model, ids, mask, completion, graphs=False, experts="model")
    assert torch.equal(ours, theirs)


# --- resident experts (mxfp4_experts.py): decoded from the checkpoint's own bytes ------------------------------------

@pytest.fixture(scope="module")
def tiny_bf16():
    """The tiny MXFP4 checkpoint loaded in bf16 (the GPU's dtype, which the kernel takes) both ways: resident, and
    dequantized."""
    from tes_grpo.model.model_loading import load_training_model, resolve_model_path

    path = resolve_model_path("tiny")
    return path, {experts: load_training_model(path, dtype=torch.bfloat16, experts=experts, say=lambda line: None)
                  .requires_grad_(False) for experts in ("mxfp4", "bf16")}  # frozen, as under LoRA


def test_resident_layers_are_packed_as_they_are(tiny_bf16):
    from tes_grpo.experts.mxfp4 import to_hopper_layout
    from tes_grpo.experts.mxfp4_checkpoint import SafetensorsCheckpoint

    path, models = tiny_bf16
    said = []
    packs = md.pack_model(models["mxfp4"].model.layers, say=said.append)
    assert len(said) == 1 and "2 layers decode from their resident MXFP4 experts" in said[0] and "no copy" in said[0]
    checkpoint = SafetensorsCheckpoint(path)
    requantized = md.pack_model(models["bf16"].model.layers, say=lambda line: None)  # today's second copy
    for i, (layer, pack) in enumerate(zip(models["mxfp4"].model.layers, packs, strict=True)):
        experts = layer.mlp.experts
        assert pack.resident and not requantized[i].resident
        for field, name in (("gate_up_blocks", "gate_up_proj_blocks"), ("gate_up_scales", "gate_up_proj_scales"),
                            ("down_blocks", "down_proj_blocks"), ("down_scales", "down_proj_scales")):
            assert getattr(pack, field) is getattr(experts, name)  # the module's own tensor: no copy
            assert torch.equal(getattr(pack, field), to_hopper_layout(
                checkpoint[f"model.layers.{i}.mlp.experts.{name}"], name.rpartition("_")[2]))
            assert torch.equal(getattr(requantized[i], field), getattr(pack, field))
    assert md.packed_experts(models["mxfp4"].model.layers[0].mlp.experts) == (packs[0], False)  # kept


def test_a_resident_pack_is_redone_when_its_scales_change_in_place(tiny_bf16):
    """A change to the resident scales alone makes a new pack (a retiled copy holds the scales too)."""
    _, models = tiny_bf16
    experts = models["mxfp4"].model.layers[1].mlp.experts
    pack, _ = md.packed_experts(experts)
    experts.down_proj_scales.add_(0)  # an in-place write: the buffer's version moves, its values stay
    again, fresh = md.packed_experts(experts)
    assert fresh and again is not pack
    experts._buffers["down_proj_scales"] = experts.down_proj_scales.clone()  # replaced (a reload): version 0 again
    third, fresh = md.packed_experts(experts)
    assert fresh and third is not again and third.down_scales is experts.down_proj_scales


def test_a_resident_layer_the_bits_upcasts_cannot_give_exactly_gets_a_tile_order_copy(tiny_bf16):
    """A resident group at scale 0 under nonzero codes: the pack is a tile-order copy run with DOT_SCALED (said,
    with its size); the resident buffers stay as they were."""
    from tes_grpo.experts.mxfp4_experts import checkpoint_tensor, put_checkpoint_tensor
    from tes_grpo.model.model_loading import load_training_model

    path, _ = tiny_bf16
    model = load_training_model(path, dtype=torch.bfloat16, experts="mxfp4", say=lambda line: None)
    experts = model.model.layers[1].mlp.experts
    blocks, scales = (checkpoint_tensor(experts, f"down_proj_{part}") for part in ("blocks", "scales"))
    blocks[2, 5, 0] = 0x11  # expert 2, output 5, the first 32 inputs: code 1 (0.5) ...
    scales[2, 5, 0] = 0  # ... at scale 0
    for name, tensor in (("down_proj_blocks", blocks), ("down_proj_scales", scales)):
        put_checkpoint_tensor(experts, name, tensor)
    said = []
    packs = md.pack_model(model.model.layers, say=said.append)
    assert packs[0].resident and packs[0].tiles == md.TILES
    assert not packs[1].resident and packs[1].tiles == md.DOT_SCALED and not packs[1].exact
    assert packs[1].down_blocks.dim() == 5 and experts.down_proj_blocks.dim() == 3  # tile order; the buffer kept
    assert any("1 layers' resident experts copied in tile order for tl.dot_scaled" in line for line in said)
    assert any("layers [1] have scales the kernel's own upcasts do not give exactly" in line for line in said)
    assert torch.equal(packs[1].checkpoint_layout("down")[1], scales)


def test_resident_float32_experts_are_not_packed(tiny_bf16):
    from tes_grpo.model.model_loading import load_training_model

    path, _ = tiny_bf16
    model = load_training_model(path, experts="mxfp4", say=lambda line: None)  # float32 on the CPU
    assert md.pack_blockers(model.model.layers[0].mlp.experts) == [
        "the resident experts compute in torch.float32 (the kernel takes bf16)"]


@runs_kernel
@pytest.mark.slow
def test_graph_decode_samples_the_same_tokens_from_resident_experts(tiny_bf16):
    """The resident model through the MXFP4 kernel and through its own (dequantizing) MLP, against the dequantized
    load's: the same tokens from the same random numbers."""
    from tes_grpo.sampling import graph_decode

    _, models = tiny_bf16
    ids = torch.randint(10, 201088, (4, 11), generator=torch.Generator().manual_seed(2))
    mask = torch.ones_like(ids)
    mask[2, :4] = 0
    config = GenerationConfig(max_new_tokens=10, do_sample=True, temperature=1.0, top_p=1.0, pad_token_id=199999,
                              eos_token_id=[200002])
    outputs = {}
    for name, model, experts in (("bf16", models["bf16"], "model"), ("resident kernel", models["mxfp4"], "mxfp4"),
                                 ("resident mlp", models["mxfp4"], "model")):
        torch.manual_seed(7)
        outputs[name] = graph_decode.generate(model, ids, mask, config, graphs=False, experts=experts,
                                              say=lambda line: None)
    assert outputs["bf16"].shape[1] > 11
    assert torch.equal(outputs["bf16"], outputs["resident kernel"])
    assert torch.equal(outputs["bf16"], outputs["resident mlp"])


def test_an_unknown_routing_is_refused():
    mlp = random_mlp()
    x = torch.randn(3, mlp.router.hidden_dim).to(torch.bfloat16)
    with pytest.raises(ValueError, match="routing='sorted'; valid: 'auto', 'torch', 'triton', 'fused'"):
        md.moe_forward(mlp, md.pack_experts(mlp.experts), x, routing="sorted")


@runs_kernel
def test_the_fused_routing_gives_the_routers_output_bit_for_bit():
    # the router's product, top-k and softmax, and the routing, from moe_routing's one program: the same output as
    # the router module and torch's routing (these logits have no ties among a token's largest)
    mlp = random_mlp(seed=3)
    x = torch.randn(16, mlp.router.hidden_dim, generator=torch.Generator().manual_seed(3)).to(torch.bfloat16)
    pack = md.pack_experts(mlp.experts)
    logits = torch.nn.functional.linear(x, mlp.router.weight, mlp.router.bias)
    top = logits.float().topk(mlp.router.top_k + 1).values
    assert (top[:, :-1] > top[:, 1:]).all()  # no ties: torch.topk's order is the only one
    with interpreted("tes_grpo.experts.moe_routing"):
        fused = md.moe_forward(mlp, pack, x, routing="fused")
    assert torch.equal(fused, md.moe_forward(mlp, pack, x, routing="torch"))


@runs_kernel
def test_a_router_with_hooks_is_called_as_a_module(monkeypatch):
    # where auto would fuse the router's top-k (a CUDA step), a router with hooks is called as a module instead, its
    # rows routed by the routing program; asked for by name, the fused routing refuses it
    mlp = random_mlp()
    calls = []
    mlp.router.register_forward_hook(lambda module, args, out: calls.append(1))
    assert not md.plain_router(mlp.router) and md.plain_router(random_mlp().router)
    pack = md.pack_experts(mlp.experts)
    x = torch.randn(3, mlp.router.hidden_dim, generator=torch.Generator().manual_seed(0)).to(torch.bfloat16)
    reference = md.moe_forward(mlp, pack, x, routing="torch")
    calls.clear()
    monkeypatch.setattr(md, "routing_for", lambda device_type, rows: "fused")
    with interpreted("tes_grpo.experts.moe_routing"):
        out = md.moe_forward(mlp, pack, x)
    assert calls == [1] and torch.equal(out, reference)
    with pytest.raises(ValueError, match="routing='fused' computes GptOssTopKRouter's forward"):
        md.moe_forward(mlp, pack, x, routing="fused")


@pytest.mark.parametrize("device_type, rows, expected", [
    ("cuda", 256, "fused"),  # 64 sequences x 4: a default GRPO step's decode
    ("cuda", 1, "fused"),  # one sequence
    ("cuda", 257, "torch"),  # past the measured break-even: the program's work grows with the rows squared
    ("cuda", 512, "torch"),  # GENERATION_STEPS=2's 128 sequences
    ("cpu", 4, "torch"),  # no compiled Triton on the CPU
])
def test_auto_routing(device_type, rows, expected):
    assert md.routing_for(device_type, rows) == expected
