"""gpt-oss's MoE experts computed from MXFP4 weights while decoding. Library module, not a script.

graph_decode.py calls `moe_forward` in place of the model's MLP when DECODE_EXPERTS resolves to mxfp4; the benchmark
times it against the bf16 experts:

    python benchmarks/bench_mxfp4_decode.py      # GPU machine: kernel check, timings, decode speed

Why: at 64 sequences x top-4 of 32 experts nearly every expert is hit at every decode step, so a step reads all the
expert weights, the larger part of a decode step's memory traffic. gpt-oss ships them as MXFP4 (4.25 bits a value),
~3.7x fewer bytes than bf16 (BENCHMARKS.md, "The experts read as MXFP4 while decoding", times both). When training holds
bf16 experts (the checkpoint loaded dequantized), this module packs a second, MXFP4 copy of the frozen experts for
sampling only (the experts' MXFP4 size again on the GPU; the memory plan counts it); when they are resident as MXFP4
(mxfp4_experts.py), a layer's blocks and scales go to the kernel as they are, with no copy. Both are kept in
OpenAI triton_kernels' Hopper MXFP4 layout (mxfp4.to_hopper_layout), the order the kernel reads.

It is the same policy, not an approximation: a layer is packed only when the round trip gives the bf16 weights back
bit for bit (`pack_experts` checks every expert; true for weights loaded from an MXFP4 checkpoint, since MXFP4
values are exact in bf16 and the quantizer takes the smallest shared exponent). The kernel then multiplies the same
numbers; what can differ from transformers' grouped_mm is the order of the float32 sums inside a dot product. Each
bf16 rounding of transformers' forward (matmul output, + bias, the gate's steps, x routing weight) is repeated.

Kernel (mxfp4_kernels.experts_kernel): one Triton program per (expert, tile of output columns) loops over the rows
routed to its expert (sorted by expert, as transformers' grouped_mm path sorts them) and over K one tile at a time (no
masks on the weights: the padding holds zeros). By default (TILES, Tiles.upcast="hopper") a lane's loaded bytes are its
tensor-core operand registers, unpacked by triton_kernels' PTX (`mxfp4_kernels._hopper_unpack`: two instructions a
value; Hopper has no MXFP4 tensor cores; on older GPUs the same bit operations in Triton's language, not measured on
one), then multiplied by the scales (an exact bf16 multiply by a power of two) and by x with `tl.dot`, the weights as
the dot's left operand (Tiles.swap: out^T = W^T x^T, wide weight tiles and the few rows as the narrow side, the shape
Hopper's warpgroup MMA takes with the upcast tile in registers). A layer whose scales that upcast does not give exactly
(upcast_is_exact: 255, or 0 under nonzero codes) runs DOT_SCALED on a copy in tile order (mxfp4.to_tile_order) instead:
`tl.dot_scaled`, Triton's own upcast. Tiles.upcast="bits" (`mxfp4_kernels._mxfp4_to_bf16` on tile order) is a third
variant, for benchmarks. Every variant multiplies the same bf16 numbers and rounds the same epilogue; `Tiles` says which
one runs. A program's BLOCK_N x BLOCK_K is the stored tile (mxfp4.TILE); other tiles and layouts read a copy (`retiled`,
benchmarks only).
The gate_up launch applies gpt-oss's clamped SwiGLU before it stores; the down launch adds the bias, multiplies by
the routing weight and writes each row back to its token's slot. No host reads, fixed shapes: CUDA-graph capturable.

Needs Triton on a CUDA device. On CPU the same kernels run under Triton's interpreter (mxfp4_kernels imported under
TRITON_INTERPRET=1), which is how the tests check them without a GPU.
"""

from __future__ import annotations

import dataclasses
import functools
import time
import weakref
from dataclasses import dataclass

import torch
import triton
from transformers.models.gpt_oss.modeling_gpt_oss import GptOssTopKRouter

from tes_grpo.experts import moe_routing, mxfp4_kernels
from tes_grpo.experts.mxfp4 import (
    BLOCK_SIZE,
    HOPPER_WARPS,
    TILE,
    dequantize_mxfp4,
    from_hopper_layout,
    from_tile_order,
    hopper_shape,
    quantize_mxfp4,
    tile_order_shape,
    to_hopper_layout,
    to_tile_order,
)
from tes_grpo.experts.mxfp4_experts import is_resident, matrix_sizes
from tes_grpo.triton_support import interpreted

UPCASTS = ("dot_scaled", "bits", "hopper")  # Tiles.upcast


@dataclass(frozen=True)
class Tiles:
    """Kernel launch shape and variant. Defaults from benchmarks/bench_mxfp4_decode.py's sweep on an H100
    (BENCHMARKS.md); rows per tile: 16 is the smallest a tensor-core dot takes as its left operand (8 with swap,
    where the rows are the right operand's columns), and a decode step routes ~8 rows to an expert (64 sequences x
    4 / 32). upcast="bits" is exact for E8M0 scales 1..254 and for all-zero groups at scale 0 (_mxfp4_to_bf16);
    a nonzero group at scale 0 (values below 2^-124, which mxfp4.quantize_mxfp4 writes for such tiny groups) reads
    as zeros, and 255 (NaN in the format) as infinities; the kernel reads no scale on the host to check it.
    upcast="hopper" (the default) reads the Hopper layout the experts are kept in (mxfp4.to_hopper_layout), with
    the same exactness as "bits"; "bits" and "dot_scaled" read tile order (mxfp4.to_tile_order), a copy.
    ptx: "hopper" unpacks with OpenAI triton_kernels' PTX where the GPU has it (compute capability 9.0 or newer:
    mul.bf16x2), else, or when False, with the same bit operations in Triton's language."""

    block_m: int = 16
    block_n: int = TILE[0]  # the stored tile's outputs and inputs (mxfp4.TILE); others read a copy (retiled)
    block_k: int = TILE[1]
    num_warps: int = HOPPER_WARPS  # "hopper": the scales' layout is made for this many (others read a copy)
    num_stages: int = 4
    upcast: str = "hopper"  # "hopper": _hopper_unpack, then tl.dot; "bits": _mxfp4_to_bf16; "dot_scaled": Triton's
    swap: bool = True  # upcast="bits" or "hopper": the weight tile is the dot's left operand (acc [BLOCK_N, BLOCK_M])
    ptx: bool = True  # upcast="hopper": triton_kernels' PTX on a GPU that has it; False: Triton's bit operations

    def __post_init__(self):
        if self.upcast not in UPCASTS:
            raise ValueError(f"Tiles: upcast={self.upcast!r}; valid: {', '.join(map(repr, UPCASTS))}")
        if self.swap and self.upcast == "dot_scaled":
            raise ValueError(f"Tiles: swap=True needs upcast='bits' or 'hopper' (got upcast={self.upcast!r})")
        if self.upcast == "hopper" and not (self.swap and self.block_k % 128 == 0 and self.block_m >= 16
                                            and self.block_n % (32 * self.num_warps) == 0):
            # block_m 8 gave other sums than transformers' MLP on the H100 (BENCHMARKS.md), unexplained
            raise ValueError(f"Tiles: upcast='hopper' needs swap=True, block_m >= 16, block_k a multiple of 128 and "
                             f"block_n of 32 x num_warps (got {self})")

    @property
    def layout(self) -> str:
        """How the weights must be stored for these tiles: "hopper" (mxfp4.to_hopper_layout, at num_warps) or
        "tiles" (mxfp4.to_tile_order)."""
        return "hopper" if self.upcast == "hopper" else "tiles"

    @property
    def tile(self) -> tuple[int, int]:
        """The tile a program reads, the weights padded to whole ones: (BLOCK_N, BLOCK_K)."""
        return self.block_n, self.block_k


TILES = Tiles()  # the fastest bit-equal variant and shape of bench_mxfp4_decode.py's sweeps (BENCHMARKS.md)
# for a layer whose scales the Hopper and bits upcasts do not give exactly (upcast_is_exact): Triton's upcast, on a
# copy in tile order, at the tiles it was measured with
DOT_SCALED = Tiles(upcast="dot_scaled", swap=False, num_stages=3)


def upcast_mxfp4(blocks: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """Tiles.upcast="bits"'s upcast on its own (one program), to check it: blocks [R, G, 16], scales [R, G] uint8
    (R and G powers of two) -> [R, G * 32] bf16."""
    rows, groups, _ = blocks.shape
    out = torch.empty(rows, groups * BLOCK_SIZE, dtype=torch.bfloat16, device=blocks.device)
    mxfp4_kernels.upcast_kernel[(1,)](blocks.contiguous(), scales.contiguous(), out, ROWS=rows,
                                      BLOCK_K=groups * BLOCK_SIZE, INTERPRETED=interpreted(mxfp4_kernels.upcast_kernel))
    return out


def experts_matmul(x, x_rows, offsets, blocks, scales, size, bias, *, swiglu=None, weights=None, out_rows=None,
                   tiles: Tiles = TILES) -> torch.Tensor:
    """One launch of the experts kernel; see mxfp4_kernels.experts_kernel. x [T, K] bf16 (contiguous), x_rows [S] (the
    row of x for sorted row r), offsets [E + 1] (sorted rows of expert e: offsets[e]:offsets[e+1]), blocks/scales the
    weights [E, N, K] in the layout `tiles` reads (layout_shapes: mxfp4.to_hopper_layout's or, tile order at tiles.tile,
    mxfp4.to_tile_order's), size (N, K), bias [E, N]. swiglu=(alpha, limit) applies gpt-oss's gate (out [S, N/2]);
    weights [S'] with out_rows [S] writes row r, times weights[out_rows[r]], to out[out_rows[r]] (out [S', N])."""
    n, k = size
    experts = blocks.shape[0]
    if x.shape[-1] != k or x.dtype != torch.bfloat16:
        raise ValueError(f"experts_matmul: x {tuple(x.shape)} {x.dtype} does not match the weights' {k} inputs "
                         "(needs bf16 x)")
    shapes = layout_shapes(tiles, experts, n, k)
    if [tuple(blocks.shape), tuple(scales.shape)] != shapes:
        raise ValueError(f"experts_matmul: tiles {tiles} read [E, {n}, {k}] weights in the {tiles.layout} layout of "
                         f"shapes {shapes}, got {[tuple(blocks.shape), tuple(scales.shape)]} (retiled makes a copy)")
    rows = x_rows.shape[0]
    shape = (rows, n // 2) if swiglu else ((weights.shape[0] if weights is not None else rows), n)
    out = torch.empty(shape, dtype=torch.bfloat16, device=x.device)
    alpha, limit = swiglu if swiglu else (0.0, 0.0)
    grid = (experts, triton.cdiv(n, tiles.block_n))
    mxfp4_kernels.experts_kernel[grid](
        x, x_rows, offsets, blocks, scales, bias, weights if weights is not None else bias, out,
        out_rows if out_rows is not None else x_rows, n, k, float(alpha), float(limit),
        SWIGLU=bool(swiglu), ROUTED_OUT=weights is not None, UPCAST_BITS=tiles.upcast == "bits", SWAP=tiles.swap,
        HOPPER=tiles.upcast == "hopper", PTX=tiles.ptx and x.is_cuda and _has_ptx_unpack(x.device.index),
        NUM_WARPS=tiles.num_warps, INTERPRETED=interpreted(mxfp4_kernels.experts_kernel), BLOCK_M=tiles.block_m,
        BLOCK_N=tiles.block_n, BLOCK_K=tiles.block_k, num_warps=tiles.num_warps, num_stages=tiles.num_stages)
    return out


@functools.cache
def _has_ptx_unpack(device_index: int | None) -> bool:
    """Whether mxfp4_kernels._hopper_unpack's PTX runs on this device: NVIDIA (not ROCm, whose devices also report
    capabilities) of compute capability 9.0 or newer (mul.bf16x2)."""
    return torch.version.hip is None and torch.cuda.get_device_capability(device_index) >= (9, 0)


@dataclass
class PackedExperts:
    """One layer's experts as MXFP4 in the layout its `tiles` read (the Hopper layout, mxfp4.to_hopper_layout:
    blocks [E, N / 4, 2 K], scales [E, N / 32, K]; or tile order, mxfp4.to_tile_order at `tile`: blocks [E, N tiles,
    K tiles, tile rows, tile bytes], scales likewise) with each weight's (out, in) size, the bf16 biases (the
    module's own tensors), and the parameter versions they were packed from."""

    gate_up_blocks: torch.Tensor
    gate_up_scales: torch.Tensor
    down_blocks: torch.Tensor
    down_scales: torch.Tensor
    gate_up_size: tuple[int, int]  # (out, in) = (2 x intermediate, hidden)
    down_size: tuple[int, int]  # (hidden, intermediate)
    gate_up_bias: torch.Tensor
    down_bias: torch.Tensor
    alpha: float
    limit: float
    versions: tuple
    resident: bool = False  # the blocks/scales are the module's own resident buffers (mxfp4_experts.py), no copy
    tiles: Tiles = TILES  # what moe_forward runs this pack with unless told otherwise
    exact: bool = True  # the bits upcasts give every weight exactly (upcast_is_exact); else only dot_scaled runs it

    @property
    def experts(self) -> int:
        return self.gate_up_blocks.shape[0]

    @property
    def tile(self) -> tuple[int, int]:
        """The tile the weights are kept in (padded to): (outputs, inputs) of a tile."""
        if self.tiles.layout == "hopper":
            return self.tiles.tile
        return self.gate_up_blocks.shape[3], self.gate_up_blocks.shape[4] * 2

    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in (self.gate_up_blocks, self.gate_up_scales,
                                                         self.down_blocks, self.down_scales))

    def checkpoint_layout(self, proj: str, experts: slice = slice(None)) -> tuple[torch.Tensor, torch.Tensor]:
        """Projection `proj` ("gate_up" or "down") of `experts` as the checkpoint's blocks [E, N, K/32, 16] and
        scales [E, N, K/32] (new tensors)."""
        size = getattr(self, f"{proj}_size")
        parts = [getattr(self, f"{proj}_{part}")[experts] for part in ("blocks", "scales")]
        if self.tiles.layout == "hopper":
            return tuple(from_hopper_layout(t, part, *size, warps=self.tiles.num_warps)
                         for t, part in zip(parts, ("blocks", "scales"), strict=True))
        return tuple(from_tile_order(t, part, *size) for t, part in zip(parts, ("blocks", "scales"), strict=True))


def upcast_is_exact(blocks: torch.Tensor, scales: torch.Tensor) -> bool:
    """Whether Tiles.upcast="hopper" and "bits" give these weights (the checkpoint's layout, or tile order) exactly
    (Tiles: scales 1..254, and scale 0 only for groups whose codes are all zeros of either sign). Reads the weights
    once, an expert at a time (one expert's scratch), and the answer once at the end (one host read)."""
    return not bool(_inexact_flag(blocks, scales))


def _inexact_flag(blocks: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    if blocks.dim() == 3:  # the same number of bytes, but a scale's codes are not where the reshape below looks
        raise ValueError("upcast_is_exact: blocks/scales in the Hopper layout; read them back first "
                         "(PackedExperts.checkpoint_layout, pack_is_exact)")
    inexact = torch.zeros((), dtype=torch.bool, device=scales.device)
    for e in range(scales.shape[0]):
        groups = blocks[e].reshape(*scales.shape[1:], BLOCK_SIZE // 2)
        nonzero = (groups & 0x77).amax(dim=-1) > 0  # a code's 3 magnitude bits, both nibbles
        inexact |= ((scales[e] == 255) | ((scales[e] == 0) & nonzero)).any()
    return inexact


def pack_is_exact(pack: PackedExperts) -> bool:
    """upcast_is_exact for every weight of a pack, whatever its layout: first from the scales alone (no 0 or 255
    anywhere, the padding's 127 included, is exact); else each expert is read back (the Hopper layout) and checked
    group by group. One host read, or two."""
    suspect = torch.zeros((), dtype=torch.bool, device=pack.gate_up_scales.device)
    for scales in (pack.gate_up_scales, pack.down_scales):
        for e in range(pack.experts):  # one expert's scratch at a time
            suspect |= ((scales[e] == 0) | (scales[e] == 255)).any()
    if not bool(suspect):
        return True
    inexact = torch.zeros((), dtype=torch.bool, device=pack.gate_up_scales.device)
    for proj in ("gate_up", "down"):
        for e in range(pack.experts):
            inexact |= _inexact_flag(*pack.checkpoint_layout(proj, slice(e, e + 1)))
    return not bool(inexact)


def layout_shapes(tiles: Tiles, experts: int, n: int, k: int) -> list[tuple]:
    """The shapes of an [experts, n, k] weight's blocks and scales in the layout `tiles` reads (Tiles.layout)."""
    if tiles.layout == "hopper":
        return [hopper_shape(part, experts, n, k, tiles.tile) for part in ("blocks", "scales")]
    return [tile_order_shape(part, experts, n, k, tiles.tile) for part in ("blocks", "scales")]


def _in_layout(blocks: torch.Tensor, scales: torch.Tensor, tiles: Tiles) -> tuple[torch.Tensor, torch.Tensor]:
    """The checkpoint's blocks/scales of one weight in the layout `tiles` reads."""
    if tiles.layout == "hopper":
        return (to_hopper_layout(blocks, "blocks", tiles.tile, tiles.num_warps),
                to_hopper_layout(scales, "scales", tiles.tile, tiles.num_warps))
    return to_tile_order(blocks, "blocks", tiles.tile), to_tile_order(scales, "scales", tiles.tile)


def retiled(pack: PackedExperts, tiles: Tiles) -> PackedExperts:
    """The pack to run with `tiles`: itself when its weights are in the layout and tile `tiles` reads, else a copy
    of them in it (benchmarks try other tiles and layouts this way, and a layer that only dot_scaled gives exactly
    gets its tile-order copy; never made inside a CUDA graph capture). ValueError for an upcast that would not give
    the pack's weights exactly (PackedExperts.exact)."""
    if not pack.exact and tiles.upcast != "dot_scaled":
        raise ValueError(f"retiled: upcast={tiles.upcast!r} would not give these weights exactly (scales 255, or 0 "
                         "under nonzero codes); only upcast='dot_scaled' runs them")
    if pack.tiles.layout == tiles.layout and pack.tile == tiles.tile and (
            tiles.layout == "tiles" or pack.tiles.num_warps == tiles.num_warps):  # the Hopper scales' order needs it
        return dataclasses.replace(pack, tiles=tiles)
    if pack.gate_up_blocks.is_cuda and torch.cuda.is_current_stream_capturing():
        raise RuntimeError("retiled: a copy in another layout or tile must be made before a CUDA graph capture")
    copies = {}
    for proj in ("gate_up", "down"):
        copies[f"{proj}_blocks"], copies[f"{proj}_scales"] = _in_layout(*pack.checkpoint_layout(proj), tiles)
    return dataclasses.replace(pack, **copies, resident=False, tiles=tiles)


def pack_blockers(experts) -> list[str]:
    """Why this experts module cannot be decoded from an MXFP4 copy ([] = it can be packed; exactness is checked
    while packing)."""
    reasons = []
    if is_resident(experts):  # already MXFP4: only the activations' dtype matters
        if experts.expert_dtype != torch.bfloat16:
            reasons.append(f"the resident experts compute in {experts.expert_dtype} (the kernel takes bf16)")
        return reasons
    kind = getattr(type(experts), "without_fused", type(experts))  # fused_experts' training variant decodes as its own
    if kind.__name__ != "GptOssExperts":
        reasons.append(f"experts are {kind.__name__} (LoRA on the experts, or not gpt-oss)")
        return reasons
    for name in ("gate_up_proj", "down_proj"):
        param = getattr(experts, name, None)
        if not isinstance(param, torch.Tensor) or param.dim() != 3:
            reasons.append(f"{name} is not a 3-D tensor")
        elif param.requires_grad:
            reasons.append(f"{name} is trained (a packed copy would go stale)")
        elif param.dtype != torch.bfloat16:
            reasons.append(f"{name} is {param.dtype} (the kernel takes bf16)")
        elif param.shape[1] % BLOCK_SIZE:
            reasons.append(f"{name} has {param.shape[1]} inputs, not a multiple of {BLOCK_SIZE}")
    return reasons


def _pack_param(param: torch.Tensor, name: str) -> tuple[torch.Tensor, torch.Tensor]:
    """[E, in, out] bf16 -> (blocks, scales) in the checkpoint's layout; raises ValueError unless the bf16 values
    come back bit for bit."""
    blocks, scales = [], []
    for e in range(param.shape[0]):
        weight = param[e].detach().t()
        b, s = quantize_mxfp4(weight)
        if not torch.equal(dequantize_mxfp4(b, s, torch.bfloat16), weight):
            raise ValueError(f"{name}[{e}] is not exactly MXFP4 (its weights were not loaded from an MXFP4 "
                             "checkpoint, or were changed since)")
        blocks.append(b)
        scales.append(s)
    return torch.stack(blocks), torch.stack(scales)


def pack_experts(experts) -> PackedExperts:
    """The experts' MXFP4 copy in the Hopper layout (or, resident, their own tensors, kept in it), to run with
    TILES; where the bits upcasts would not give every weight exactly (upcast_is_exact), a copy in tile order to run
    with DOT_SCALED. ValueError names what prevents packing (pack_blockers, or weights not exactly MXFP4)."""
    reasons = pack_blockers(experts)
    if reasons:
        raise ValueError("; ".join(reasons))
    sizes = matrix_sizes(experts)
    resident = is_resident(experts)
    if resident:  # the checkpoint's bytes in the Hopper layout (mxfp4_experts.py keeps them so), as they are
        tensors = (experts.gate_up_proj_blocks, experts.gate_up_proj_scales, experts.down_proj_blocks,
                   experts.down_proj_scales)
    else:
        tensors = (*_in_layout(*_pack_param(experts.gate_up_proj, "gate_up_proj"), TILES),
                   *_in_layout(*_pack_param(experts.down_proj, "down_proj"), TILES))
    pack = PackedExperts(*tensors, sizes["gate_up_proj"], sizes["down_proj"], experts.gate_up_proj_bias,
                         experts.down_proj_bias, float(experts.alpha), float(experts.limit), _versions(experts),
                         resident=resident)
    if not pack_is_exact(pack):
        return retiled(dataclasses.replace(pack, exact=False), DOT_SCALED)
    return pack


_PACKS: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # experts module -> PackedExperts or why not


def _versions(experts) -> tuple | None:
    """The versions of the parameters a pack is made of or copies from (resident experts' blocks and scales, or the
    bf16 weights), with where their data lives: a tensor replaced (a buffer reloaded, moved) starts at version 0
    again."""
    names = (("gate_up_proj_blocks", "gate_up_proj_scales", "down_proj_blocks", "down_proj_scales")
             if is_resident(experts) else ("gate_up_proj", "down_proj"))
    params = [getattr(experts, name, None) for name in names]
    if not all(isinstance(p, torch.Tensor) for p in params):
        return None
    return tuple((p._version, p.device, p.data_ptr()) for p in params)


def packed_experts(experts) -> tuple[PackedExperts | str, bool]:
    """(pack_experts' result or the reason it failed, whether it was computed now): kept per module and redone only
    when its weights changed in place or were replaced (_versions)."""
    kept = _PACKS.get(experts)
    if kept is not None and kept[0] == _versions(experts):
        return kept[1], False
    try:
        result = pack_experts(experts)
    except ValueError as err:
        result = str(err)
    _PACKS[experts] = (_versions(experts), result)
    return result, True


def pack_model(layers, say=print, tiles: Tiles = TILES) -> list[PackedExperts | None]:
    """Every layer's packed experts (None for a layer that cannot be packed), each to run with its own tiles
    (pack_experts: TILES, or DOT_SCALED on a tile-order copy where the bits upcasts are not exact) or, given other
    tiles, with those (a copy in their layout and tile where those differ from the pack's: retiled, made here so a
    captured step finds it). Says what it packed or copied, which layers upcast through tl.dot_scaled, and why a
    layer keeps its bf16 experts, when that was worked out now (later calls reuse the packs silently)."""
    start = time.perf_counter()
    packs, new, resident, inexact, copied, reasons = [], [], [], [], [], {}
    for i, layer in enumerate(layers):
        result, fresh = packed_experts(layer.mlp.experts)
        packs.append(result if isinstance(result, PackedExperts) else None)
        if fresh and isinstance(result, PackedExperts):
            kept_in = resident if result.resident else copied if is_resident(layer.mlp.experts) else new
            kept_in.append(result)
            if not result.exact:
                inexact.append(i)
        elif fresh:
            reasons.setdefault(result, []).append(i)
    if new:
        say(f"DECODE_EXPERTS=mxfp4: packed {len(new)} layers' experts as MXFP4 for decoding "
            f"({sum(p.nbytes() for p in new) / 2**30:.2f} GiB, {time.perf_counter() - start:.1f} s)")
    if resident:
        say(f"DECODE_EXPERTS=mxfp4: {len(resident)} layers decode from their resident MXFP4 experts "
            f"({sum(p.nbytes() for p in resident) / 2**30:.2f} GiB, no copy)")
    if copied:
        say(f"DECODE_EXPERTS=mxfp4: {len(copied)} layers' resident experts copied in tile order for tl.dot_scaled "
            f"({sum(p.nbytes() for p in copied) / 2**30:.2f} GiB more, which the memory plan does not count)")
    for reason, ids in reasons.items():
        say(f"DECODE_EXPERTS=mxfp4: layers {ids} decode with their bf16 experts ({reason})")
    if inexact:
        say(f"DECODE_EXPERTS=mxfp4: layers {inexact} have scales the kernel's own upcasts do not give exactly (255, "
            "or 0 under nonzero codes), so they upcast through tl.dot_scaled (slower, exact)")
    if tiles == TILES:
        return packs
    ran = [None if pack is None else retiled(pack, tiles) for pack in packs]
    copies = [new for old, new in zip(packs, ran, strict=True)
              if new is not None and new.gate_up_blocks is not old.gate_up_blocks]
    if copies:
        order = "the Hopper layout" if tiles.layout == "hopper" else f"{tiles.tile} tile order"
        say(f"DECODE_EXPERTS=mxfp4: {len(copies)} layers' experts copied in {order} for tiles {tiles} "
            f"({sum(p.nbytes() for p in copies) / 2**30:.2f} GiB more)")
    return ran


ROUTE_IN_ONE_PROGRAM_UP_TO = 256  # routed rows (tokens x k) up to which a CUDA step routes them with moe_routing
ROUTINGS = ("torch", "triton", "fused")  # moe_forward's routings besides "auto"


def routing_for(device_type: str, rows: int) -> str:
    """moe_forward's routing="auto": "fused" (the router's top-k and the routing in moe_routing's one program) on
    CUDA for up to ROUTE_IN_ONE_PROGRAM_UP_TO routed rows, where bench_mxfp4_decode.py measured one program faster
    than torch's kernels; "torch" otherwise. moe_forward takes "triton" instead of "fused" for a router that is not
    plain_router."""
    return "fused" if device_type == "cuda" and rows <= ROUTE_IN_ONE_PROGRAM_UP_TO else "torch"


def plain_router(router) -> bool:
    """Whether `router` is gpt-oss's GptOssTopKRouter running its class's forward with no hooks: what the fused
    routing computes (its product, then the top-k and the softmax). Anything else (an adapter on the router, a
    forward replaced on the instance, hooks) is called as a module."""
    return (type(router) is GptOssTopKRouter and "forward" not in vars(router) and not router._forward_hooks
            and not router._forward_pre_hooks)


def moe_forward(mlp, packed: PackedExperts, hidden: torch.Tensor, tiles: Tiles | None = None,
                routing: str = "auto") -> torch.Tensor:
    """gpt-oss's MLP (router, top-k experts, weighted sum: transformers 5.17-5.24's GptOssMLP.forward,
    GptOssTopKRouter.forward and grouped_mm_experts_forward's roundings) for hidden [..., H] with the experts read from
    `packed`, by the kernel with `tiles` (default: the pack's own, PackedExperts.tiles; its tile must be the pack's
    order).
    routing: how the router's top-k is taken and the routed rows sorted by expert: "torch" (the router module, then
    sort, searchsorted, division), "triton" (the router module, then moe_routing.route_with_triton: the same tensors
    from one program) or "fused" (the router's product, then moe_routing.top_k_route_with_triton: the top-k and the
    routing from one program, the softmax as the router takes it; the same but for the order of equal logits, which
    top_k_route_with_triton says); "auto": routing_for's choice. A device and a shape decide it, so a captured step
    reads nothing on the host."""
    shape = hidden.shape
    x = hidden.reshape(-1, shape[-1])
    router = mlp.router
    if routing not in ("auto", *ROUTINGS):
        raise ValueError(f"moe_forward: routing={routing!r}; valid: 'auto', " + ", ".join(map(repr, ROUTINGS)))
    chosen = routing_for(x.device.type, x.shape[0] * router.top_k) if routing == "auto" else routing
    if chosen == "fused" and not plain_router(router):
        if routing == "fused":
            raise ValueError(f"moe_forward: routing='fused' computes GptOssTopKRouter's forward; this router is "
                             f"{type(router).__name__} or has hooks")
        chosen = "triton"
    experts = packed.experts
    if chosen == "fused":
        logits = torch.nn.functional.linear(x, router.weight, router.bias)  # the router's own product
        values, indices, order, offsets, token_rows = moe_routing.top_k_route_with_triton(logits, router.top_k)
        scores = torch.nn.functional.softmax(values, dim=1, dtype=values.dtype)  # as GptOssTopKRouter.forward
    else:
        _, scores, indices = router(x)  # transformers >= 5.17: logits, top-k weights [T, k], expert ids [T, k]
        route = {"torch": moe_routing.route_with_torch, "triton": moe_routing.route_with_triton}  # as imported now
        order, offsets, token_rows = route[chosen](indices, experts)
    tokens, top_k = indices.shape
    tiles = tiles or packed.tiles
    gated = experts_matmul(x.contiguous(), token_rows, offsets, packed.gate_up_blocks, packed.gate_up_scales,
                           packed.gate_up_size, packed.gate_up_bias, swiglu=(packed.alpha, packed.limit), tiles=tiles)
    sequence_rows = torch.arange(order.shape[0], device=x.device)
    routed = experts_matmul(gated, sequence_rows, offsets, packed.down_blocks, packed.down_scales, packed.down_size,
                            packed.down_bias, weights=scores.reshape(-1).to(torch.bfloat16), out_rows=order,
                            tiles=tiles)
    # transformers sums the k weighted rows of a token in float32 and rounds once
    return routed.view(tokens, top_k, -1).sum(dim=1).to(hidden.dtype).view(shape)
