"""MXFP4 expert weights dequantized to the tensor transformers' dequantized load holds: blocks and scales (in the
checkpoint's layout, tile order or the Hopper layout) -> [E, in, out], bit for bit.

Library module, not a script. The resident experts (mxfp4_experts.py) dequantize each layer through
`dequantize_experts` when it runs, the resident loader (model_loading.load_resident_model) the layers that keep
bf16 experts; benchmarks/bench_mxfp4_load.py times both ways:

    python benchmarks/bench_mxfp4_load.py      # GPU machine: load, dequantization, one MoE layer both ways

On CUDA a Triton kernel (mxfp4_kernels.dequantize_kernel) writes the [E, in, out] weights straight from the packed
bytes; elsewhere, and on CUDA without Triton (said once), torch's codec (mxfp4.dequantize_mxfp4), one expert at a
time. Both give the values of transformers' integrations.mxfp4.convert_moe_packed_tensors, which the tests check for
every byte at every scale.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from tes_grpo.experts.mxfp4 import (
    BLOCK_SIZE,
    HOPPER_WARPS,
    TILE,
    dequantize_mxfp4,
    from_hopper_layout,
    from_tile_order,
    hopper_shape,
    tile_order_shape,
)
from tes_grpo.run.processes import SayOnce
from tes_grpo.triton_support import triton_installed

# the dequantization kernel's program: rows (outputs) x columns (inputs), warps; benchmarks/bench_mxfp4_load.py times
# others (DEQUANT_TILES)
DEQUANT_TILE = (64, 64, 4)  # tile order and the checkpoint's layout
DEQUANT_HOPPER = (128, 64, 4)  # the Hopper layout: its smallest whole piece (32 x HOPPER_WARPS rows, 64 columns)

__all__ = ["DEQUANT_HOPPER", "DEQUANT_TILE", "dequantize_experts", "dequantize_with_torch", "dequantize_with_triton"]

_say_once = SayOnce()  # the fallback without Triton is met by every layer of every pass: said the first time


@dataclass(frozen=True)
class _Layout:
    """Where an [E, rows, cols] weight's codes and scales are: `tile` the tile order's tile (the checkpoint's layout:
    the whole matrix), or with `hopper` the Hopper layout padded to whole tiles of `tile` (mxfp4.TILE)."""

    rows: int
    cols: int
    tile: tuple[int, int]
    hopper: bool = False


def _layout(blocks: torch.Tensor, scales: torch.Tensor, size: tuple[int, int] | None) -> _Layout:
    """The layout of blocks/scales: the checkpoint's ([E, out, in/32, 16] / [E, out, in/32]; size None), tile order
    (mxfp4.to_tile_order, 5-D) or the Hopper layout (mxfp4.to_hopper_layout at mxfp4.TILE and HOPPER_WARPS, 3-D),
    size = (out, in); ValueError otherwise."""
    if blocks.dtype != torch.uint8 or scales.dtype != torch.uint8:
        raise ValueError(f"MXFP4 blocks and scales must be uint8, got {blocks.dtype} and {scales.dtype}")
    if size is None:
        if blocks.dim() != 4 or blocks.shape[:-1] != scales.shape or blocks.shape[-1] != BLOCK_SIZE // 2:
            raise ValueError(f"blocks {tuple(blocks.shape)} / scales {tuple(scales.shape)} are not the checkpoint's "
                             "[E, out, in/32, 16] / [E, out, in/32]")
        rows, cols = blocks.shape[1], blocks.shape[2] * BLOCK_SIZE
        return _Layout(rows, cols, (rows, cols))
    rows, cols = size
    if blocks.dim() == 3:
        if [tuple(blocks.shape), tuple(scales.shape)] != [
                hopper_shape(part, blocks.shape[0], rows, cols, TILE) for part in ("blocks", "scales")]:
            raise ValueError(f"blocks {tuple(blocks.shape)} / scales {tuple(scales.shape)} are not a [E, {rows}, "
                             f"{cols}] weight in the Hopper layout ([E, rows / 4, 2 cols] / [E, rows / 32, cols], "
                             f"padded to whole {TILE[0]} x {TILE[1]} tiles)")
        return _Layout(rows, cols, TILE, hopper=True)
    tile = (blocks.shape[3], blocks.shape[4] * 2) if blocks.dim() == 5 else (0, 0)
    ok = tile[0] > 0 and tile[1] % BLOCK_SIZE == 0
    if not ok or [tuple(blocks.shape), tuple(scales.shape)] != [
            tile_order_shape(part, blocks.shape[0], rows, cols, tile) for part in ("blocks", "scales")]:
        raise ValueError(f"blocks {tuple(blocks.shape)} / scales {tuple(scales.shape)} are not a [E, {rows}, {cols}] "
                         "weight in tile order ([E, row tiles, column tiles, tile rows, tile columns / 2 or / 32]) "
                         "or in the Hopper layout")
    return _Layout(rows, cols, tile)


def dequantize_with_triton(blocks: torch.Tensor, scales: torch.Tensor, dtype: torch.dtype,
                           program: tuple[int, int, int] | None = None,
                           size: tuple[int, int] | None = None) -> torch.Tensor:
    """dequantize_experts through the Triton kernel (mxfp4_kernels.dequantize_kernel: a CUDA device, or CPU tensors with
    mxfp4_kernels imported under TRITON_INTERPRET=1); program: (rows, columns, warps) of a program (default
    DEQUANT_TILE, or DEQUANT_HOPPER for the Hopper layout)."""
    layout = _layout(blocks, scales, size)
    block_r, block_c, num_warps = program or (DEQUANT_HOPPER if layout.hopper else DEQUANT_TILE)
    if layout.hopper and (block_r % (32 * HOPPER_WARPS) or block_c % 64):
        raise ValueError(f"dequantize_with_triton: a program reads the Hopper layout in pieces of {32 * HOPPER_WARPS} "
                         f"rows and 64 columns, got {program}")
    from tes_grpo.experts import mxfp4_kernels  # Triton is optional on the CPU; only this path needs it

    experts = blocks.shape[0]
    out = torch.empty(experts, layout.cols, layout.rows, dtype=dtype, device=blocks.device)
    grid = (experts, -(-layout.rows // block_r), -(-layout.cols // block_c))
    kind = {torch.float32: 0, torch.bfloat16: 1}.get(dtype, 2)
    mxfp4_kernels.dequantize_kernel[grid](
        blocks.contiguous(), scales.contiguous(), out, layout.rows, layout.cols, OUT_KIND=kind, HOPPER=layout.hopper,
        WARPS=HOPPER_WARPS, TILE_R=layout.tile[0], TILE_C=layout.tile[1], BLOCK_R=block_r, BLOCK_C=block_c,
        num_warps=num_warps)
    return out


def dequantize_with_torch(blocks: torch.Tensor, scales: torch.Tensor, dtype: torch.dtype,
                          size: tuple[int, int] | None = None) -> torch.Tensor:
    """dequantize_experts through torch's codec (mxfp4.dequantize_mxfp4), one expert at a time so the float32
    scratch stays one expert's size."""
    layout = _layout(blocks, scales, size)
    rows, cols = layout.rows, layout.cols
    out = torch.empty(blocks.shape[0], cols, rows, dtype=dtype, device=blocks.device)
    for e in range(blocks.shape[0]):
        b, s = blocks[e:e + 1], scales[e:e + 1]
        if layout.hopper:
            b, s = from_hopper_layout(b, "blocks", rows, cols), from_hopper_layout(s, "scales", rows, cols)
        elif size is not None:
            b, s = from_tile_order(b, "blocks", rows, cols), from_tile_order(s, "scales", rows, cols)
        out[e].copy_(dequantize_mxfp4(b[0], s[0], dtype).t())
    return out


def dequantize_experts(blocks: torch.Tensor, scales: torch.Tensor, dtype: torch.dtype,
                       size: tuple[int, int] | None = None) -> torch.Tensor:
    """A checkpoint's expert blocks/scales (or, with size = (out, in), the same in the Hopper layout, what a
    resident module keeps, or in tile order) -> transformers' expert parameter [E, in, out] (contiguous, `dtype`):
    the values transformers 5.17-5.24's dequantized load holds (integrations.mxfp4.convert_moe_packed_tensors), bit
    for bit. On CUDA through the Triton kernel; on the CPU (and on CUDA without Triton, said once) through torch's
    codec."""
    if blocks.is_cuda:
        if triton_installed():
            return dequantize_with_triton(blocks, scales, dtype, size=size)
        _say_once("no-triton", "MXFP4 experts: no triton installed, so each layer's experts are dequantized with "
                               "torch's codec (slower than the Triton kernel, same values)")
    return dequantize_with_torch(blocks, scales, dtype, size=size)
