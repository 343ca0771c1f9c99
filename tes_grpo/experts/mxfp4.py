"""MXFP4 codec and checkpoint writer in OpenAI's gpt-oss layout (no GPU, no triton needed).

Library module, not a script. Used by the tiny-model builder and by `export_quantized_model.py`:
    from tes_grpo.experts.mxfp4 import quantize_mxfp4, dequantize_mxfp4, write_mxfp4_checkpoint

Format (as in openai/gpt-oss-20b and transformers' `integrations/mxfp4.py`):
- a weight `[..., rows, cols]` is cut into blocks of 32 consecutive values along `cols`;
- each value is FP4 E2M1 (codes 0..15 -> +0, .5, 1, 1.5, 2, 3, 4, 6, -0, -.5, ..., -6), two per byte,
  the low nibble holding the even element: `blocks` uint8 `[..., rows, cols/32, 16]`;
- each block has one E8M0 scale byte (exponent + 127): `scales` uint8 `[..., rows, cols/32]`;
- value = FP4[code] * 2**(scale - 127).

In the checkpoint, expert weights are stored as `[experts, out, in]` (`gate_up_proj_blocks`
`[E, 2I, H/32, 16]`, `down_proj_blocks` `[E, H, I/32, 16]`), while transformers' `GptOssExperts`
holds the transposed `[experts, in, out]` parameters (`gate_up_proj` `[E, H, 2I]`, `down_proj`
`[E, I, H]`); `expert_param_to_mxfp4` / `mxfp4_to_expert_param` do that transpose.
"""

from __future__ import annotations

import functools
import json
import os
import re
from collections.abc import Iterator, Mapping
from pathlib import Path

import torch
from safetensors import safe_open
from safetensors.torch import save_file

BLOCK_SIZE = 32  # values per shared E8M0 scale (MX spec)
FP4_VALUES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0)
FP4_MAX = 6.0
E8M0_BIAS = 127
# openai/gpt-oss-20b and -120b config.json: everything but the MoE experts stays bf16.
MODULES_TO_NOT_CONVERT = ["model.layers.*.self_attn", "model.layers.*.mlp.router", "model.embed_tokens", "lm_head"]
EXPERT_PARAM_RE = re.compile(r"^(?P<prefix>.*\.mlp\.experts)\.(?P<proj>gate_up_proj|down_proj)$")
CHECKPOINT_EXPERT_RE = re.compile(
    r"^(?P<prefix>.*\.mlp\.experts)\.(?P<proj>gate_up_proj|down_proj)_(?P<part>blocks|scales)$")
DEFAULT_MAX_SHARD_BYTES = 5 * 1024**3  # same shard size as the hub checkpoints
ROWS_PER_CHUNK = 1 << 16  # rows of 32-value blocks quantized at once; bounds float32 scratch memory

# Midpoints between consecutive non-negative FP4 magnitudes; a value on a midpoint rounds to the even
# code (mantissa bit 0), as IEEE round-to-nearest-even does.
_MAGNITUDES = torch.tensor(FP4_VALUES[:8], dtype=torch.float32)
_MIDPOINTS = (_MAGNITUDES[1:] + _MAGNITUDES[:-1]) / 2


def _powers_of_two(exp: torch.Tensor) -> torch.Tensor:
    """2**exp in float64, exactly, for integer exp in [-1022, 1023]: built from the exponent bits. With torch.ldexp
    (a float64 exponent) in these comparisons, a block whose maximum is exactly 6 x 2**-4 got 2**-3 on CUDA (torch
    2.11) and 2**-4 on the CPU: the two codecs chose different scales."""
    return ((exp.to(torch.int64) + 1023) << 52).view(torch.float64)


def _shared_exponents(amax: torch.Tensor) -> torch.Tensor:
    """Smallest exponent e per block with amax / 2**e <= 6, so no value clips (triton's ROUND_UP rule)."""
    amax = amax.double()
    safe = torch.where(amax > 0, amax, torch.ones_like(amax))
    exp = torch.ceil(torch.log2(safe / FP4_MAX)).to(torch.int64)
    # log2 in floating point can be off by one next to powers of two; fix with exact comparisons.
    exp = torch.where(FP4_MAX * _powers_of_two(exp) < safe, exp + 1, exp)
    exp = torch.where(FP4_MAX * _powers_of_two(exp - 1) >= safe, exp - 1, exp)
    exp = torch.where(amax > 0, exp, torch.full_like(exp, -E8M0_BIAS))
    return exp.clamp(-E8M0_BIAS, E8M0_BIAS).to(torch.int32)


def _fp4_codes(scaled: torch.Tensor) -> torch.Tensor:
    """Nearest FP4 E2M1 code (0..15) for each float32 value already divided by its block scale."""
    magnitude = scaled.abs().clamp(max=FP4_MAX)
    code = torch.bucketize(magnitude, _MIDPOINTS.to(scaled.device), right=False)
    on_midpoint = (code < 7) & (magnitude == _MIDPOINTS.to(scaled.device)[code.clamp(max=6)])
    code = torch.where(on_midpoint & (code % 2 == 1), code + 1, code)
    negative = torch.signbit(scaled) & (code > 0)
    return (code + 8 * negative.to(code.dtype)).to(torch.uint8)


def quantize_mxfp4(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """`w [..., rows, cols]` -> (`blocks` uint8 `[..., rows, cols/32, 16]`, `scales` uint8 `[..., rows, cols/32]`).

    The shared exponent per block of 32 is the smallest one that keeps the block maximum within
    FP4's +-6 (no clipping); values round to the nearest FP4 value, ties to even.
    """
    if w.dim() < 2:
        raise ValueError(f"quantize_mxfp4 needs a tensor [..., rows, cols], got shape {tuple(w.shape)}")
    if w.shape[-1] % BLOCK_SIZE:
        raise ValueError(f"last dimension {w.shape[-1]} is not a multiple of the MXFP4 block size {BLOCK_SIZE}")
    if not torch.isfinite(w).all():
        raise ValueError("quantize_mxfp4: tensor has NaN or inf values")
    *lead, cols = w.shape
    groups = cols // BLOCK_SIZE
    flat = w.reshape(-1, BLOCK_SIZE)
    blocks = torch.empty(flat.shape[0], BLOCK_SIZE // 2, dtype=torch.uint8, device=w.device)
    scales = torch.empty(flat.shape[0], dtype=torch.uint8, device=w.device)
    for start in range(0, flat.shape[0], ROWS_PER_CHUNK):
        chunk = flat[start:start + ROWS_PER_CHUNK].float()
        exp = _shared_exponents(chunk.abs().amax(dim=1))
        # a power of two times a bf16 value is exact in float64; back in float32 only values far below FP4's
        # smallest step (0.5) can lose bits, and they round to code 0 either way
        scaled = (chunk.double() * _powers_of_two(-exp).unsqueeze(1)).float()
        codes = _fp4_codes(scaled)
        blocks[start:start + ROWS_PER_CHUNK] = codes[:, 0::2] | (codes[:, 1::2] << 4)
        scales[start:start + ROWS_PER_CHUNK] = (exp + E8M0_BIAS).to(torch.uint8)
    return blocks.reshape(*lead, groups, BLOCK_SIZE // 2), scales.reshape(*lead, groups)


def dequantize_mxfp4(blocks: torch.Tensor, scales: torch.Tensor, dtype: torch.dtype = torch.bfloat16) -> torch.Tensor:
    """Inverse of `quantize_mxfp4`: (`[..., rows, G, 16]`, `[..., rows, G]`) -> `[..., rows, G*32]` in `dtype`."""
    if blocks.dtype != torch.uint8 or scales.dtype != torch.uint8:
        raise ValueError(f"blocks and scales must be uint8, got {blocks.dtype} and {scales.dtype}")
    if blocks.shape[:-1] != scales.shape or blocks.shape[-1] != BLOCK_SIZE // 2:
        raise ValueError(f"blocks {tuple(blocks.shape)} and scales {tuple(scales.shape)} do not match "
                         f"the layout [..., rows, G, 16] / [..., rows, G]")
    lut = torch.tensor(FP4_VALUES, dtype=torch.float32, device=blocks.device)
    values = torch.empty(*blocks.shape[:-1], BLOCK_SIZE, dtype=torch.float32, device=blocks.device)
    values[..., 0::2] = lut[(blocks & 0x0F).long()]
    values[..., 1::2] = lut[(blocks >> 4).long()]
    # an integer exponent, as transformers' dequantizer passes it: 0 * 2**128 (scale 255) is then 0, not nan
    values = torch.ldexp(values, (scales.to(torch.int32) - E8M0_BIAS).unsqueeze(-1))
    return values.reshape(*scales.shape[:-1], scales.shape[-1] * BLOCK_SIZE).to(dtype)


def expert_param_to_mxfp4(param: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """transformers' expert parameter `[E, in, out]` -> checkpoint (`blocks [E, out, in/32, 16]`, `scales`)."""
    return quantize_mxfp4(param.detach().transpose(-1, -2))


def mxfp4_to_expert_param(blocks: torch.Tensor, scales: torch.Tensor,
                          dtype: torch.dtype = torch.bfloat16) -> torch.Tensor:
    """Checkpoint blocks/scales -> transformers' expert parameter `[E, in, out]` (what `from_pretrained` builds)."""
    return dequantize_mxfp4(blocks, scales, dtype).transpose(-1, -2).contiguous()


def expert_rounding_bound(blocks: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """Per-element bound of the MXFP4 rounding of an expert parameter in transformers' `[E, in, out]` layout, from
    its checkpoint blocks/scales: 2**exponent of each value's block."""
    step = torch.ldexp(torch.ones(scales.shape), scales.int() - E8M0_BIAS).repeat_interleave(BLOCK_SIZE, dim=-1)
    return step.transpose(-1, -2)


def fake_quantize_expert_param(param: torch.Tensor) -> torch.Tensor:
    """The expert parameter as it reads back after an MXFP4 round trip, same dtype and shape."""
    return mxfp4_to_expert_param(*expert_param_to_mxfp4(param), dtype=param.dtype)


# ---------------------------------------------------------------------------------------------------------------
# Tiles, and tile order: each tile of a weight contiguous (the copies mxfp4_decode's tl.dot_scaled variant reads)
# ---------------------------------------------------------------------------------------------------------------

TILE = (128, 128)  # (outputs, inputs) of one tile: what mxfp4_decode's kernel reads in one K step; the padding unit
TILE_FILL = {"blocks": 0, "scales": E8M0_BIAS}  # padding: code 0 at scale 2**0, the value 0


def _tile_columns(part: str, tile: tuple[int, int]) -> int:
    """A tile's bytes along a row: a byte holds 2 values (blocks), a scale covers BLOCK_SIZE (scales)."""
    if part not in TILE_FILL:
        raise ValueError(f"tile order: part {part!r}; valid: 'blocks', 'scales'")
    return tile[1] // 2 if part == "blocks" else tile[1] // BLOCK_SIZE


def tiles_of(rows: int, cols: int, tile: tuple[int, int] = TILE) -> tuple[int, int]:
    """(tiles down the outputs, tiles along the inputs) of a [rows, cols] weight, the last ones padded."""
    return -(-rows // tile[0]), -(-cols // tile[1])


def tile_order_shape(part: str, experts: int, rows: int, cols: int, tile: tuple[int, int] = TILE) -> tuple:
    """The tile-ordered shape of a [experts, rows (out), cols (in)] weight's blocks or scales:
    [experts, row tiles, column tiles, tile rows, a tile row's bytes]."""
    return (experts, *tiles_of(rows, cols, tile), tile[0], _tile_columns(part, tile))


def padded_bytes(rows: int, cols: int, tile: tuple[int, int] = TILE) -> int:
    """Bytes of one expert's [rows, cols] weight padded to whole tiles, blocks and scales (17 bytes a padded
    32-block): what it takes in tile order and in the Hopper layout alike."""
    row_tiles, col_tiles = tiles_of(rows, cols, tile)
    return row_tiles * tile[0] * col_tiles * tile[1] * 17 // 32


def to_tile_order(tensor: torch.Tensor, part: str, tile: tuple[int, int] = TILE) -> torch.Tensor:
    """Checkpoint blocks [E, rows, cols/32, 16] or scales [E, rows, cols/32] (part "blocks" or "scales") -> tile
    order (tile_order_shape): each tile's bytes contiguous, row by row, so a kernel reads one tile as one piece.
    The padding of the last tiles holds the value 0 (TILE_FILL). Works on meta tensors."""
    per_tile = _tile_columns(part, tile)
    if tile[0] <= 0 or tile[1] <= 0 or tile[1] % BLOCK_SIZE:
        raise ValueError(f"tile order: tile {tile} needs rows > 0 and columns a positive multiple of {BLOCK_SIZE}")
    if tensor.dim() != (4 if part == "blocks" else 3):
        raise ValueError(f"tile order: {part} of shape {tuple(tensor.shape)} are not the checkpoint's "
                         + ("[E, rows, cols/32, 16]" if part == "blocks" else "[E, rows, cols/32]"))
    experts, rows, groups = tensor.shape[:3]
    flat = tensor.reshape(experts, rows, -1)
    row_tiles, col_tiles = tiles_of(rows, groups * BLOCK_SIZE, tile)
    padded = flat.new_full((experts, row_tiles * tile[0], col_tiles * per_tile), TILE_FILL[part])
    padded[:, :rows, :flat.shape[2]] = flat
    return padded.view(experts, row_tiles, tile[0], col_tiles, per_tile).permute(0, 1, 3, 2, 4).contiguous()


def from_tile_order(tensor: torch.Tensor, part: str, rows: int, cols: int) -> torch.Tensor:
    """Inverse of to_tile_order for a [E, rows, cols] weight: the checkpoint's blocks or scales, contiguous."""
    if tensor.dim() != 5:
        raise ValueError(f"tile order: {part} of shape {tuple(tensor.shape)} are not in tile order "
                         "([E, row tiles, column tiles, tile rows, tile bytes])")
    experts, row_tiles, col_tiles, tile_rows, per_tile = tensor.shape
    wide = col_tiles * per_tile * (2 if part == "blocks" else BLOCK_SIZE)
    if cols % BLOCK_SIZE or not (0 < rows <= row_tiles * tile_rows and 0 < cols <= wide):
        raise ValueError(f"tile order: a [{rows}, {cols}] weight (columns a multiple of {BLOCK_SIZE}) is not what "
                         f"{part} of shape {tuple(tensor.shape)} hold (at most [{row_tiles * tile_rows}, {wide}])")
    flat = tensor.permute(0, 1, 3, 2, 4).reshape(experts, row_tiles * tile_rows, col_tiles * per_tile)
    groups = cols // BLOCK_SIZE
    kept = flat[:, :rows, :groups * (BLOCK_SIZE // 2) if part == "blocks" else groups]
    return (kept.reshape(experts, rows, groups, BLOCK_SIZE // 2) if part == "blocks" else kept).contiguous()


# ---------------------------------------------------------------------------------------------------------------
# The Hopper layout: how the resident experts are kept (mxfp4_experts.py) and what mxfp4_decode's kernel reads
# ---------------------------------------------------------------------------------------------------------------

HOPPER_WARPS = 4  # warps of the kernel that reads the scales' layout (HopperMXScaleLayout's num_warps)
_HOPPER_VALUE_ORDER = (0, 1, 4, 7, 11, 5, 10, 8, 2, 9, 3, 6, 12)  # the permutation of _hopper_views' values view
_HOPPER_SCALE_ORDER = (0, 1, 3, 6, 2, 5, 7, 4)  # and of its scales view


def _hopper_views(rows_pad: int, cols_pad: int, warps: int) -> tuple[list[int], list[int]]:
    """The sizes one expert's padded bytes [1, rows_pad, cols_pad / 2] and scales [1, rows_pad, cols_pad / 32] are
    viewed with before the layout's permutation, as OpenAI triton_kernels builds it (Triton 3.6: HopperMXValueLayout,
    mma_version 3: rows in 16-row groups, then 2, 4, 2; bytes in 32-byte groups, then 4, 2, 4; the 1s are that
    library's singleton axes, kept so the permutation reads as its own. HopperMXScaleLayout: rows in groups of
    32 x warps, then 2, warps, 2, 8; scales in pairs of 32-column groups)."""
    values = [1, rows_pad // 16, 1, 2, 4, 2, 1, cols_pad // 64, 4, 2, 4, 1, 1]
    scales = [1, rows_pad // (32 * warps), 2, warps, 2, 8, cols_pad // 64, 2]
    return values, scales


def _unsigned_shift(x: torch.Tensor, bits: int) -> torch.Tensor:
    return (x >> bits) & ((1 << (32 - bits)) - 1)


def _placed_code(code: torch.Tensor, fourth: bool) -> torch.Tensor:
    """One FP4 code's bits where a 16-bit half of a word holds them: sign at bit 15 and magnitude at bits 8..6 (the
    word's first three bytes, shifted right by 0, 3, 6 when combined), or for the fourth byte sign at 14,
    magnitude bits 2 and 1 at 11 and 10, bit 0 at 13."""
    if fourth:
        return ((code & 0x8) << 11) | ((code & 0x6) << 9) | ((code & 0x1) << 13)
    return ((code & 0x8) << 12) | ((code & 0x7) << 6)


def _placed_bytes(fourth: bool = False) -> torch.Tensor:
    """Every byte value's two codes placed (_placed_code): the low nibble in the low half, the high in the high."""
    byte = torch.arange(256, dtype=torch.int32)
    return _placed_code(byte & 0xF, fourth) | (_placed_code(byte >> 4, fourth) << 16)


@functools.cache
def _hopper_word_bits(device: str) -> tuple[torch.Tensor, torch.Tensor]:
    """A word's bits from its first two bytes and from its last two, by their 16-bit value (little-endian): two
    lookups a word, since the bytes' placed bits never overlap."""
    pair = torch.arange(1 << 16, dtype=torch.int32)
    low, high = pair & 0xFF, pair >> 8
    first = _placed_bytes()[low] | _unsigned_shift(_placed_bytes(), 3)[high]
    last = _unsigned_shift(_placed_bytes(), 6)[low] | _placed_bytes(fourth=True)[high]
    return first.to(device), last.to(device)


def _hopper_bits(data: torch.Tensor) -> torch.Tensor:
    """Every 4 bytes (8 FP4 codes) -> one little-endian word with the codes' bits where the unpacking's masks and
    shifts find them (triton_kernels' hopper_value._pack_bits; mxfp4_kernels._hopper_halves reads them)."""
    words = (data.contiguous() if data.storage_offset() % 4 == 0 else data.clone()).view(torch.int32)
    first, last = _hopper_word_bits(str(data.device))
    placed = first[(words & 0xFFFF).long()] | last[_unsigned_shift(words, 16).long()]
    return placed.view(torch.uint8).reshape(data.shape)


def _code_from(halves: torch.Tensor, sign: int, magnitude: torch.Tensor) -> torch.Tensor:
    return (((halves >> sign) & 1) << 3) | magnitude


def _hopper_unbits(data: torch.Tensor) -> torch.Tensor:
    """Inverse of _hopper_bits: each word's 8 codes back into its 4 bytes."""
    word = data.contiguous().view(torch.int32).reshape(*data.shape[:-1], -1, 1)
    halves = torch.cat([word & 0xFFFF, _unsigned_shift(word, 16)], dim=-1)  # low nibbles, high nibbles
    codes = [_code_from(halves, 15, (halves >> 6) & 7), _code_from(halves, 12, (halves >> 3) & 7),
             _code_from(halves, 9, halves & 7),
             _code_from(halves, 14, (((halves >> 11) & 1) << 2) | (((halves >> 10) & 1) << 1) | ((halves >> 13) & 1))]
    return torch.stack([c[..., 0] | (c[..., 1] << 4) for c in codes], dim=-1).to(torch.uint8).reshape(data.shape)


def hopper_shape(part: str, experts: int, rows: int, cols: int, tile: tuple[int, int] = TILE) -> tuple:
    """The Hopper-layout shape of a [experts, rows (out), cols (in)] weight's blocks ([E, rows / 4, 2 cols]) or
    scales ([E, rows / 32, cols]), rows and cols padded to whole tiles."""
    _tile_columns(part, tile)
    rows, cols = (-(-rows // tile[0]) * tile[0], -(-cols // tile[1]) * tile[1])
    return (experts, rows // 4, 2 * cols) if part == "blocks" else (experts, rows // 32, cols)


def _check_hopper_tile(tile: tuple[int, int], warps: int) -> None:
    if tile[0] % (32 * warps) or tile[1] % 128:
        raise ValueError(f"Hopper layout: tile {tile} needs rows a multiple of 32 x {warps} warps and columns a "
                         "multiple of 128")


def to_hopper_layout(tensor: torch.Tensor, part: str, tile: tuple[int, int] = TILE,
                     warps: int = HOPPER_WARPS) -> torch.Tensor:
    """Checkpoint blocks [E, rows, cols/32, 16] or scales [E, rows, cols/32] -> OpenAI triton_kernels' Hopper MXFP4
    layout (Triton 3.6: HopperMXValueLayout, mma_version 3; HopperMXScaleLayout at `warps` warps), the weight padded
    to whole tiles with the value 0 (TILE_FILL): blocks [E, rows / 4, 2 cols], where each lane of a warpgroup loads
    its MMA operand registers for 4 K steps of 16 as 16 contiguous bytes, their bits pre-placed (_hopper_bits) so
    two instructions a value unpack them; scales [E, rows / 32, cols], a warp's 32 rows of one column group
    together. One expert at a time (the scratch stays one expert's size); on meta tensors, the shape."""
    _check_hopper_tile(tile, warps)
    if tensor.dim() != (4 if part == "blocks" else 3):
        raise ValueError(f"Hopper layout: {part} of shape {tuple(tensor.shape)} are not the checkpoint's "
                         + ("[E, rows, cols/32, 16]" if part == "blocks" else "[E, rows, cols/32]"))
    experts, rows, groups = tensor.shape[:3]
    out = tensor.new_empty(hopper_shape(part, experts, rows, groups * BLOCK_SIZE, tile))
    if tensor.is_meta:
        return out
    rows_pad = -(-rows // tile[0]) * tile[0]
    cols_pad = -(-groups * BLOCK_SIZE // tile[1]) * tile[1]
    per_row = cols_pad // 2 if part == "blocks" else cols_pad // BLOCK_SIZE
    values, scales = _hopper_views(rows_pad, cols_pad, warps)
    for e in range(experts):
        padded = tensor.new_full((1, rows_pad, per_row), TILE_FILL[part])
        padded[:, :rows, :groups * (BLOCK_SIZE // 2 if part == "blocks" else 1)] = tensor[e:e + 1].reshape(1, rows, -1)
        if part == "scales":
            out[e] = padded.view(scales).permute(*_HOPPER_SCALE_ORDER).reshape(rows_pad // 32, cols_pad)
        else:
            out[e] = _hopper_bits(padded.view(values).permute(*_HOPPER_VALUE_ORDER).reshape(rows_pad // 4,
                                                                                           2 * cols_pad))
    return out


def from_hopper_layout(tensor: torch.Tensor, part: str, rows: int, cols: int,
                       warps: int = HOPPER_WARPS) -> torch.Tensor:
    """Inverse of to_hopper_layout for a [E, rows, cols] weight: the checkpoint's blocks or scales, contiguous (one
    expert at a time)."""
    if tensor.dim() != 3:
        raise ValueError(f"Hopper layout: {part} of shape {tuple(tensor.shape)} are not in the Hopper layout "
                         "([E, rows / 4, 2 cols] or [E, rows / 32, cols])")
    experts = tensor.shape[0]
    rows_pad, cols_pad = ((tensor.shape[1] * 4, tensor.shape[2] // 2) if part == "blocks"
                          else (tensor.shape[1] * 32, tensor.shape[2]))
    if (cols % BLOCK_SIZE or not (0 < rows <= rows_pad and 0 < cols <= cols_pad) or cols_pad % 128
            or rows_pad % (32 * warps)):
        raise ValueError(f"Hopper layout: a [{rows}, {cols}] weight (columns a multiple of {BLOCK_SIZE}) is not what "
                         f"{part} of shape {tuple(tensor.shape)} hold")
    groups = cols // BLOCK_SIZE
    values, scales = _hopper_views(rows_pad, cols_pad, warps)
    if part == "scales":
        out = tensor.new_empty(experts, rows, groups)
        for e in range(experts):
            permuted = tensor[e:e + 1].reshape([scales[d] for d in _HOPPER_SCALE_ORDER])
            flat = permuted.permute(*_inverse(_HOPPER_SCALE_ORDER)).reshape(rows_pad, cols_pad // BLOCK_SIZE)
            out[e] = flat[:rows, :groups]
        return out
    out = tensor.new_empty(experts, rows, groups, BLOCK_SIZE // 2)
    for e in range(experts):
        permuted = _hopper_unbits(tensor[e:e + 1]).reshape([values[d] for d in _HOPPER_VALUE_ORDER])
        flat = permuted.permute(*_inverse(_HOPPER_VALUE_ORDER)).reshape(rows_pad, cols_pad // 2)
        out[e] = flat[:rows, :groups * (BLOCK_SIZE // 2)].reshape(rows, groups, BLOCK_SIZE // 2)
    return out


def _inverse(order: tuple[int, ...]) -> list[int]:
    inverse = [0] * len(order)
    for position, axis in enumerate(order):
        inverse[axis] = position
    return inverse


class SafetensorsCheckpoint(Mapping):
    """Read-only, lazy `{name: tensor}` view of a safetensors checkpoint folder (single file or sharded).

    Lets the exporter copy the base model's expert blocks/scales bit for bit without loading 13 GB.
    """
    def __init__(self, folder: str | os.PathLike, only: set[str] | None = None):
        """`only`: restrict the view to these tensor names (others read as absent)."""
        self.folder = Path(folder)
        index = self.folder / "model.safetensors.index.json"
        if index.is_file():
            weight_map = json.loads(index.read_text(encoding="utf-8"))["weight_map"]
            self._files = {name: self.folder / file for name, file in weight_map.items()}
        else:
            files = sorted(self.folder.glob("*.safetensors"))
            if not files:
                raise FileNotFoundError(f"{self.folder}: no *.safetensors files")
            self._files = {}
            for file in files:
                with safe_open(str(file), framework="pt") as handle:
                    self._files.update({name: file for name in handle.keys()})
        if only is not None:
            self._files = {name: file for name, file in self._files.items() if name in only}

    def __getitem__(self, name: str) -> torch.Tensor:
        with safe_open(str(self._files[name]), framework="pt") as handle:
            return handle.get_tensor(name)

    def shape(self, name: str) -> tuple[int, ...]:
        with safe_open(str(self._files[name]), framework="pt") as handle:
            return tuple(handle.get_slice(name).get_shape())

    def __contains__(self, name) -> bool:  # Mapping's default would read the tensor
        return name in self._files

    def __iter__(self) -> Iterator[str]:
        return iter(self._files)

    def __len__(self) -> int:
        return len(self._files)


def legacy_config_keys(data: Mapping) -> dict:
    """The config.json keys of openai/gpt-oss-20b that transformers 5's `to_dict()` no longer writes.

    transformers 5 keeps RoPE only as `rope_parameters` (theta inside) and drops the original checkpoint's
    `rope_theta`, `rope_scaling` and `experts_per_token`, but other readers still take exactly those: Ollama's
    gpt-oss converter (convert/convert_gptoss.go) reads `rope_theta` (-> rope.freq_base), `rope_scaling.{rope_type,
    factor, original_max_position_embeddings, beta_fast, beta_slow}`, `experts_per_token` (-> expert_used_count) and
    `initial_context_length`, and `architectures[0]` picks its converter; a missing key silently becomes 0 there.
    Derived from the config's own values, so the two spellings cannot disagree; transformers 5 reads them back into
    the same `rope_parameters` (its `rope_scaling` wins over `rope_parameters`, `rope_theta` fills the theta in).
    """
    rope = data.get("rope_parameters")
    if isinstance(rope, Mapping) and "rope_theta" in rope and not isinstance(rope["rope_theta"], Mapping):
        theta = rope["rope_theta"]
        scaling = {key: value for key, value in rope.items() if key != "rope_theta"}
    elif data.get("rope_theta") is not None:  # an older transformers: the legacy keys are already there
        theta, scaling = data["rope_theta"], data.get("rope_scaling")
    else:
        raise ValueError(f"config has no RoPE theta (rope_parameters={rope!r}, rope_theta={data.get('rope_theta')!r}): "
                         f"cannot write rope_theta / rope_scaling for Ollama")
    keys = {"architectures": data.get("architectures") or ["GptOssForCausalLM"], "rope_theta": theta,
            "experts_per_token": data["num_experts_per_tok"]}  # the value transformers routes with
    if scaling:
        keys["rope_scaling"] = dict(scaling)
        original = scaling.get("original_max_position_embeddings")
        if original is not None:
            keys["initial_context_length"] = data.get("initial_context_length") or original
    return keys


def mxfp4_config_dict(config) -> dict:
    """config.json content: the model config plus gpt-oss's MXFP4 `quantization_config` and the original
    checkpoint's RoPE / expert keys (`legacy_config_keys`), so Ollama's converter reads it like openai/gpt-oss-20b."""
    data = dict(config) if isinstance(config, Mapping) else config.to_dict()
    data.update(legacy_config_keys(data))
    data["quantization_config"] = {"quant_method": "mxfp4", "modules_to_not_convert": list(MODULES_TO_NOT_CONVERT)}
    data["torch_dtype"] = data["dtype"] = "bfloat16"
    return data


def write_config_json(config, out_dir: str | os.PathLike) -> Path:
    """Writes `out_dir/config.json` (mxfp4_config_dict) as the checkpoint writer does; returns its path."""
    path = Path(out_dir) / "config.json"
    path.write_text(json.dumps(mxfp4_config_dict(config), indent=2, sort_keys=True) + "\n", encoding="utf-8")
    return path


def save_tokenizer_files(tokenizer, out_dir: str | os.PathLike) -> None:
    """tokenizer.save_pretrained plus the chat template inside tokenizer_config.json as well.

    transformers 5 writes the template only to chat_template.jinja, but Ollama's converter takes it only from
    tokenizer_config.json's `chat_template` (convert/tokenizer.go), and without it Ollama has no template to
    recognise as Harmony. transformers reads either file and they hold the same text.
    """
    out_dir = Path(out_dir)
    tokenizer.save_pretrained(out_dir)
    template = tokenizer.chat_template
    if not isinstance(template, str) or not template:
        raise ValueError("the tokenizer has no chat template (gpt-oss's Harmony template is needed for serving)")
    config_path = out_dir / "tokenizer_config.json"
    config = json.loads(config_path.read_text(encoding="utf-8"))
    config["chat_template"] = template
    config_path.write_text(json.dumps(config, indent=2, ensure_ascii=False) + "\n", encoding="utf-8")


def checkpoint_tensors(state_dict: Mapping[str, torch.Tensor], passthrough: Mapping[str, torch.Tensor] | None = None,
                       dtype: torch.dtype = torch.bfloat16,
                       stats: dict | None = None) -> Iterator[tuple[str, torch.Tensor]]:
    """Yields (checkpoint name, tensor) in gpt-oss's layout for a transformers `GptOss` state dict.

    Expert weights become `*_blocks` / `*_scales`: copied from `passthrough` (checkpoint names) when
    it holds both, else quantized. Floating tensors are cast to `dtype`; `stats` counts each kind.
    """
    passthrough = passthrough or {}
    stats = stats if stats is not None else {}
    for name, tensor in state_dict.items():
        match = EXPERT_PARAM_RE.match(name)
        if match is None:
            stats["bf16"] = stats.get("bf16", 0) + 1
            yield name, (tensor.detach().to(dtype) if tensor.is_floating_point() else tensor.detach())
            continue
        if tensor.dim() != 3:
            raise ValueError(f"{name}: expected a 3-D expert parameter [experts, in, out], got {tuple(tensor.shape)}")
        blocks_name, scales_name = f"{name}_blocks", f"{name}_scales"
        if blocks_name in passthrough and scales_name in passthrough:
            blocks, scales = passthrough[blocks_name], passthrough[scales_name]
            experts, inner, outer = tensor.shape
            expected = (experts, outer, inner // BLOCK_SIZE, BLOCK_SIZE // 2)
            if tuple(blocks.shape) != expected or tuple(scales.shape) != expected[:-1]:
                raise ValueError(f"{blocks_name}: passthrough blocks {tuple(blocks.shape)} / scales "
                                 f"{tuple(scales.shape)} do not fit the parameter {tuple(tensor.shape)}")
            stats["copied"] = stats.get("copied", 0) + 1
        else:
            blocks, scales = expert_param_to_mxfp4(tensor)
            stats["quantized"] = stats.get("quantized", 0) + 1
        yield blocks_name, blocks.contiguous()
        yield scales_name, scales.contiguous()


def estimate_checkpoint_bytes(state_dict: Mapping[str, torch.Tensor]) -> int:
    """Bytes the MXFP4 checkpoint will take: 17 bytes per 32 expert values, 2 bytes per other value."""
    total = 0
    for name, tensor in state_dict.items():
        if EXPERT_PARAM_RE.match(name):
            total += tensor.numel() // BLOCK_SIZE * (BLOCK_SIZE // 2 + 1)
        else:
            total += tensor.numel() * (2 if tensor.is_floating_point() else tensor.element_size())
    return total


class ShardWriter:
    """Collects tensors into safetensors shards of at most `max_shard_bytes`, named like the hub's."""
    def __init__(self, out_dir: Path, max_shard_bytes: int):
        self.out_dir, self.max_shard_bytes = Path(out_dir), max_shard_bytes
        self.current: dict[str, torch.Tensor] = {}
        self.current_bytes = 0
        self.temp_files: list[Path] = []
        self.shard_of: dict[str, int] = {}
        self.total = 0

    def add(self, name: str, tensor: torch.Tensor) -> None:
        size = tensor.numel() * tensor.element_size()
        if self.current and self.current_bytes + size > self.max_shard_bytes:
            self._flush()
        self.current[name] = tensor
        self.shard_of[name] = len(self.temp_files)
        self.current_bytes += size
        self.total += size

    def _flush(self) -> None:
        path = self.out_dir / f".shard-{len(self.temp_files):05d}.safetensors.tmp"
        save_file(self.current, str(path), metadata={"format": "pt"})
        self.temp_files.append(path)
        self.current, self.current_bytes = {}, 0

    def finish(self) -> list[str]:
        """Writes the last shard, gives the shards their final names (+ index when sharded); returns the names."""
        self._flush()
        count = len(self.temp_files)
        names = (["model.safetensors"] if count == 1
                 else [f"model-{i + 1:05d}-of-{count:05d}.safetensors" for i in range(count)])
        for temp, final in zip(self.temp_files, names, strict=True):
            os.replace(temp, self.out_dir / final)
        if count > 1:
            index = {"metadata": {"total_size": self.total},
                     "weight_map": {k: names[i] for k, i in sorted(self.shard_of.items())}}
            (self.out_dir / "model.safetensors.index.json").write_text(json.dumps(index, indent=2) + "\n",
                                                                       encoding="utf-8")
        return names


def write_mxfp4_checkpoint(model_or_state_dict, config, out_dir: str | os.PathLike, *,
                           passthrough: Mapping[str, torch.Tensor] | None = None,
                           max_shard_bytes: int = DEFAULT_MAX_SHARD_BYTES,
                           dtype: torch.dtype = torch.bfloat16) -> dict:
    """Writes `model.safetensors` (or shards + index) and `config.json` in openai/gpt-oss's MXFP4 layout.

    `model_or_state_dict`: a `GptOssForCausalLM` (bf16, dequantized) or its state dict.
    `config`: its `GptOssConfig` or a dict. `passthrough`: checkpoint-named `*_blocks`/`*_scales`
    tensors (e.g. a `SafetensorsCheckpoint` of the base) copied bit for bit instead of re-quantizing.
    Writes into `out_dir` directly (callers wanting atomicity pass a temp folder and rename it).
    Returns {"files": [...], "copied": n, "quantized": n, "bf16": n, "bytes": total}.
    """
    state_dict = model_or_state_dict if isinstance(model_or_state_dict, Mapping) else model_or_state_dict.state_dict()
    config_data = mxfp4_config_dict(config)
    if config_data.get("tie_word_embeddings") and "lm_head.weight" in state_dict:
        state_dict = {k: v for k, v in state_dict.items() if k != "lm_head.weight"}
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    stats: dict = {"copied": 0, "quantized": 0, "bf16": 0}
    writer = ShardWriter(out_dir, max_shard_bytes)
    for name, tensor in checkpoint_tensors(state_dict, passthrough, dtype, stats):
        writer.add(name, tensor)
    names = writer.finish()
    write_config_json(config_data, out_dir)
    return {"files": names, "bytes": writer.total, **stats}


__all__ = [
    "BLOCK_SIZE", "FP4_VALUES", "MODULES_TO_NOT_CONVERT", "SafetensorsCheckpoint", "ShardWriter", "checkpoint_tensors",
    "dequantize_mxfp4", "estimate_checkpoint_bytes", "expert_param_to_mxfp4", "fake_quantize_expert_param",
    "legacy_config_keys", "mxfp4_config_dict", "mxfp4_to_expert_param", "quantize_mxfp4", "save_tokenizer_files",
    "write_config_json", "write_mxfp4_checkpoint",
]
