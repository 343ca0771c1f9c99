"""The MXFP4 codec in OpenAI's gpt-oss layout, and the tile layouts the MXFP4 kernels read (no GPU, no triton
needed).

Library module, not a script. The checkpoint writer (mxfp4_checkpoint.py), the resident experts (mxfp4_experts.py)
and the decode kernels (mxfp4_decode.py) encode and decode through it:
    from tes_grpo.experts.mxfp4 import quantize_mxfp4, dequantize_mxfp4, to_hopper_layout

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

import torch

BLOCK_SIZE = 32  # values per shared E8M0 scale (MX spec)
FP4_VALUES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0)
FP4_MAX = 6.0
E8M0_BIAS = 127
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
    """Inverse of `quantize_mxfp4`: (`[..., rows, G, 16]`, `[..., rows, G]`) -> `[..., rows, G*32]` in `dtype`:
    the values of transformers 5.17-5.24's integrations.mxfp4.convert_moe_packed_tensors (its lookup table, its
    integer exponents)."""
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


__all__ = [
    "BLOCK_SIZE", "FP4_VALUES", "dequantize_mxfp4", "expert_param_to_mxfp4", "fake_quantize_expert_param",
    "mxfp4_to_expert_param", "quantize_mxfp4",
]
