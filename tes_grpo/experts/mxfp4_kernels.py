"""The Triton kernels of the MXFP4 experts: the experts product that decoding runs (mxfp4_decode.py launches it),
the dequantization that training runs (mxfp4_experts.py launches it), and the pieces they share. Library module, not
a script; imported only where Triton is installed (mxfp4_dequant imports it when it first dequantizes on CUDA).

The shared pieces read the Hopper layout the resident experts are kept in (mxfp4.to_hopper_layout, OpenAI
triton_kernels' HopperMXValueLayout / HopperMXScaleLayout): _hopper_halves takes each FP4 code out of the places
mxfp4._hopper_bits put its bits in, _hopper_unshuffle and _hopper_scales undo the layout's permutations. The decode
kernel turns the codes into bf16 values (_hopper_unpack; on Hopper with triton_kernels' PTX); the dequantization
kernel builds each value's float32 bits with integer arithmetic, exact for every byte and scale.

On the CPU the same kernels run under Triton's interpreter (TRITON_INTERPRET=1 while this module is imported and its
kernels run), which is how the tests check them without a GPU. The kernels call only triton.language's builtins, no
functions of its standard library (tl.zeros, tl.sigmoid): those were compiled when triton was first imported,
without the interpreter, and fail inside an interpreted kernel. Helpers that the interpreter runs differently from a
GPU (bf16 arithmetic) take INTERPRETED and work on the bits there.
"""

from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def _bf16(x):
    """Rounds float32 values to bf16 (to nearest, ties to even) and back: where transformers' bf16 forward rounds,
    this rounds too. Done on the bits because Triton's interpreter truncates in `.to(tl.bfloat16)` (3.9), which
    would make the CPU tests check a different rounding than the GPU does; finite values only."""
    bits = x.to(tl.uint32, bitcast=True)
    bits = (bits + 0x7FFF + ((bits >> 16) & 1)) & 0xFFFF0000
    return bits.to(tl.float32, bitcast=True)


@triton.jit
def _widen(x):
    """bf16 -> float32 on the bits (exact): Triton's interpreter (3.9) converts bf16 subnormals wrongly."""
    return (x.to(tl.uint16, bitcast=True).to(tl.uint32) << 16).to(tl.float32, bitcast=True)


@triton.jit
def _mul(a, b, INTERPRETED: tl.constexpr):
    """a * b of bf16 tensors whose products are exact in bf16 (as _mxfp4_to_bf16's are). Triton's interpreter (3.9;
    it keeps bf16 tensors as their uint16 bits) multiplies the bits as integers, so interpreted the product is taken
    in float32 and its upper half kept (exact products: nothing to round). Compiled kernels multiply in bf16."""
    if INTERPRETED:
        bits = (_widen(a) * _widen(b)).to(tl.uint32, bitcast=True) >> 16
        return bits.to(tl.uint16).to(tl.bfloat16, bitcast=True)
    return a * b


@triton.jit
def _mxfp4_to_bf16(packed, scales, ROWS: tl.constexpr, BLOCK_K: tl.constexpr, INTERPRETED: tl.constexpr):
    """[ROWS, BLOCK_K / 2] packed bytes (low nibble the even value) and their [ROWS, BLOCK_K / 32] E8M0 scales ->
    [ROWS, BLOCK_K] bf16: the values mxfp4.dequantize_mxfp4 gives, for scales 1..254.

    A code's sign bit goes to the bf16 sign bit and its 3 magnitude bits (exponent field f, mantissa bit m) to the
    bf16 exponent's two lowest bits and the mantissa's highest: the bf16 then reads as the FP4 value times 2**-126
    for every code (f = 0 lands in bf16's subnormals as E2M1's own 0.5 does), both codes of a byte in one 32-bit
    word (two integer multiplies place them, their shifted copies never overlap). Two multiplies by powers of two
    give the value: x 2**126, then x 2**(scale - 127) (the scale byte shifted into a bf16's exponent field); both
    products are exact (an overflow is inf, as in float32)."""
    word = packed.to(tl.uint32)
    word = ((word * 0x40040) & 0x01C001C0) | ((word * 0x1001000) & 0x80008000)
    low = (word & 0xFFFF).to(tl.uint16).to(tl.bfloat16, bitcast=True)
    high = (word >> 16).to(tl.uint16).to(tl.bfloat16, bitcast=True)
    values = tl.reshape(tl.join(low, high), (ROWS, BLOCK_K))
    values = _mul(values, tl.full((ROWS, BLOCK_K), 2.0**126, tl.bfloat16), INTERPRETED)
    scale = (scales.to(tl.uint16) << 7).to(tl.bfloat16, bitcast=True)
    scale = tl.reshape(tl.broadcast_to(scale[:, :, None], (ROWS, BLOCK_K // 32, 32)), (ROWS, BLOCK_K))
    return _mul(values, scale, INTERPRETED)


@triton.jit
def _dot(a, b, acc, INTERPRETED: tl.constexpr):
    """tl.dot(a, b, acc) of bf16 tiles. Triton's interpreter (3.9; it keeps bf16 tensors as their uint16 bits)
    multiplies a bf16 tl.dot's bits as integers, so interpreted the tiles are widened to float32 first: exact, and
    the float32 products and sums are the ones its tl.dot_scaled computes. Compiled kernels multiply the bf16 tiles."""
    if INTERPRETED:
        a = _widen(a)
        b = _widen(b)
    return tl.dot(a, b, acc)


@triton.jit
def upcast_kernel(blocks_ptr, scales_ptr, out_ptr, ROWS: tl.constexpr, BLOCK_K: tl.constexpr,
                   INTERPRETED: tl.constexpr):
    rows = tl.arange(0, ROWS)
    packed = tl.load(blocks_ptr + rows[:, None] * (BLOCK_K // 2) + tl.arange(0, BLOCK_K // 2)[None, :])
    scales = tl.load(scales_ptr + rows[:, None] * (BLOCK_K // 32) + tl.arange(0, BLOCK_K // 32)[None, :])
    tl.store(out_ptr + rows[:, None] * BLOCK_K + tl.arange(0, BLOCK_K)[None, :],
             _mxfp4_to_bf16(packed, scales, ROWS, BLOCK_K, INTERPRETED))


@triton.jit
def _hopper_halves(x):
    """[R, C] bytes of the Hopper layout (mxfp4.to_hopper_layout: every 4 bytes one word of 8 FP4 codes, their bits
    placed by mxfp4._hopper_bits) -> [R, 2C] uint32, one code each in the order the bytes held them (low nibble
    first), its sign at bit 15 and its 3 magnitude bits at bits 8..6: the bits of a bf16 that reads as the code's
    E2M1 value times 2**-126 (triton_kernels' masks and shifts)."""
    R: tl.constexpr = x.shape[0]
    C: tl.constexpr = x.shape[1]
    b = tl.reshape(x.to(tl.uint32), (R, C // 4, 2, 2))
    even, odd = tl.split(b)  # bytes 0 and 2, 1 and 3 of each word (little-endian)
    b0, b2 = tl.split(even)
    b1, b3 = tl.split(odd)
    word = b0 | (b1 << 8) | (b2 << 16) | (b3 << 24)
    o0 = word & 0x81C081C0
    o1 = (word << 3) & 0x81C081C0
    o2 = (word << 6) & 0x81C081C0
    o3 = ((word << 1) & 0x80008000) | ((word >> 3) & 0x01800180) | ((word >> 7) & 0x00400040)
    pairs = tl.trans(tl.join(tl.join(o0, o1), tl.join(o2, o3)), 0, 1, 3, 2)  # [R, C/4, pair, k in pair]
    words = tl.reshape(pairs, (R, C // 4, 4))
    return tl.reshape(tl.join(words & 0xFFFF, words >> 16), (R, 2 * C))  # each word: its low half first


@triton.jit
def _hopper_unpack(x, PTX: tl.constexpr, INTERPRETED: tl.constexpr):
    """[R, C] bytes of the Hopper layout -> [R, 2C] bf16, the codes' E2M1 values in the order the bytes held them (low
    nibble first): _hopper_halves' bf16 bits, then one exact multiply by 2**126. PTX: OpenAI triton_kernels' PTX (Triton
    3.6's hopper_value._unpack_fp4_to_bf16_triton, two instructions a value; mul.bf16x2 needs compute capability 9.0);
    otherwise (and interpreted) the same bit operations in Triton's language."""
    R: tl.constexpr = x.shape[0]
    C: tl.constexpr = x.shape[1]
    if not PTX or INTERPRETED:
        values = _hopper_halves(x).to(tl.uint16).to(tl.bfloat16, bitcast=True)
        return _mul(values, tl.full((R, 2 * C), 2.0**126, tl.bfloat16), INTERPRETED)
    r0, r1 = tl.inline_asm_elementwise(
        asm="""{
            .reg .b32 b, c, d<7>, bias;
            mov.b32 bias, 0x7e807e80;
            and.b32 $0, $4, 0b10000001110000001000000111000000;
            mul.bf16x2 $0, $0, bias;
            shl.b32 b, $4, 3;
            and.b32 $1, b,  0b10000001110000001000000111000000;
            mul.bf16x2 $1, $1, bias;
            shl.b32 c, $4, 6;
            and.b32 $2, c,  0b10000001110000001000000111000000;
            mul.bf16x2 $2, $2, bias;
            shl.b32 d0, $4, 1;
            and.b32 d1, d0, 0b10000000000000001000000000000000;
            shr.b32 d2, $4, 3;
            and.b32 d3, d2, 0b00000001100000000000000110000000;
            or.b32 d4, d1, d3;
            shr.b32 d5, $4, 7;
            and.b32 d6, d5, 0b00000000010000000000000001000000;
            or.b32 $3, d4, d6;
            mul.bf16x2 $3, $3, bias;
        }""",
        constraints="=r,=r,=r,=r,r", args=[x], dtype=(tl.bfloat16, tl.bfloat16), is_pure=True, pack=4)
    values = tl.reshape(tl.join(r0, r1), (R, C // 4, 4, 2))
    return tl.reshape(tl.trans(values, 0, 1, 3, 2), (R, 2 * C))


@triton.jit
def _hopper_unshuffle(x):
    """The Hopper layout's value order -> [rows, K] (triton_kernels' _unshuffle_triton, mma_version 3, bf16): [R, C]
    upcast values -> [4R, C / 4]."""
    R: tl.constexpr = x.shape[0]
    C: tl.constexpr = x.shape[1]
    x = tl.reshape(x, (R // 4, 4, C // 256, 2, 4, 8, 2, 2))
    return tl.reshape(tl.trans(x, 0, 6, 1, 3, 2, 5, 4, 7), (R * 4, C // 4))


@triton.jit
def _hopper_scales(x, NUM_WARPS: tl.constexpr):
    """The Hopper layout's scale order -> [rows, K / 32] (triton_kernels' unswizzle_mxfp4_scale_hopper): [R, C] bytes
    -> [32R, C / 32]."""
    R: tl.constexpr = x.shape[0]
    C: tl.constexpr = x.shape[1]
    x = tl.reshape(x, (R // NUM_WARPS, NUM_WARPS, C // 64, 2, 8, 2, 2))
    return tl.reshape(tl.trans(x, 0, 3, 1, 6, 4, 2, 5), (R * 32, C // 32))


@triton.jit
def experts_kernel(x_ptr, x_rows_ptr, offsets_ptr, blocks_ptr, scales_ptr, bias_ptr, weight_ptr, out_ptr,
                    out_rows_ptr, N, K, alpha, limit,
                    SWIGLU: tl.constexpr, ROUTED_OUT: tl.constexpr, UPCAST_BITS: tl.constexpr, SWAP: tl.constexpr,
                    HOPPER: tl.constexpr, PTX: tl.constexpr, NUM_WARPS: tl.constexpr, INTERPRETED: tl.constexpr,
                    BLOCK_M: tl.constexpr,
                    BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    """out[r] = f(x[x_rows[r]] @ W_e + b_e) for the rows r in offsets[e]:offsets[e+1] (rows sorted by expert).

    HOPPER (with SWAP; the default): W_e in the Hopper layout (mxfp4.to_hopper_layout: blocks [E, N / 4, 2 K] and
    scales [E, N / 32, K] bytes, padded to whole BLOCK_N x BLOCK_K tiles), upcast by _hopper_unpack (PTX: with
    triton_kernels' PTX), _hopper_unshuffle and _hopper_scales (NUM_WARPS: the scales' layout's). Otherwise W_e in
    tile order (mxfp4.to_tile_order at (BLOCK_N, BLOCK_K): blocks [E, N tiles, K tiles, BLOCK_N, BLOCK_K / 2], two
    FP4 codes a byte, low nibble first; scales [E, N tiles, K tiles, BLOCK_N, BLOCK_K / 32]), upcast by
    _mxfp4_to_bf16 and multiplied by tl.dot (UPCAST_BITS) or by tl.dot_scaled. Either way whole tiles padded with
    zeros, so the weights need no masks. SWAP: acc^T [BLOCK_N, BLOCK_M] = W_tile^T [BLOCK_N, BLOCK_K] @ x^T.
    SWIGLU: f is gpt-oss's clamped SwiGLU over interleaved (gate, up) columns, out has N/2 columns. ROUTED_OUT: f
    multiplies by weight[out_rows[r]] and the row is stored at out_rows[r]."""
    expert = tl.program_id(0)
    start = tl.load(offsets_ptr + expert)
    end = tl.load(offsets_ptr + expert + 1)
    cols = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    col_ok = cols < N
    bias = tl.load(bias_ptr + expert * N + cols, mask=col_ok, other=0.0).to(tl.float32)
    local = tl.arange(0, BLOCK_N)
    first_tile = (expert.to(tl.int64) * tl.num_programs(1) + tl.program_id(1)) * ((K + BLOCK_K - 1) // BLOCK_K)
    for row0 in range(start, end, BLOCK_M):
        rows = row0 + tl.arange(0, BLOCK_M)
        row_ok = rows < end
        src = tl.load(x_rows_ptr + rows, mask=row_ok, other=0)
        if SWAP:
            acc = tl.full((BLOCK_N, BLOCK_M), 0.0, dtype=tl.float32)
        else:
            acc = tl.full((BLOCK_M, BLOCK_N), 0.0, dtype=tl.float32)
        for k0 in range(0, K, BLOCK_K):
            ks = k0 + tl.arange(0, BLOCK_K)
            if SWAP:  # x^T [BLOCK_K, BLOCK_M], loaded transposed
                xt = tl.load(x_ptr + src[None, :].to(tl.int64) * K + ks[:, None],
                             mask=row_ok[None, :] & (ks[:, None] < K), other=0.0)
            else:
                x = tl.load(x_ptr + src[:, None].to(tl.int64) * K + ks[None, :],
                            mask=row_ok[:, None] & (ks[None, :] < K), other=0.0)
            if HOPPER:  # [BLOCK_N / 4, 2 BLOCK_K] value bytes, [BLOCK_N / 32, BLOCK_K] scales of padded rows
                k_pad = ((K + BLOCK_K - 1) // BLOCK_K) * BLOCK_K
                n_pad = tl.num_programs(1) * BLOCK_N
                w = tl.load(blocks_ptr + expert.to(tl.int64) * (n_pad * k_pad // 2)
                            + (tl.program_id(1) * (BLOCK_N // 4) + tl.arange(0, BLOCK_N // 4))[:, None] * (2 * k_pad)
                            + (2 * k0 + tl.arange(0, 2 * BLOCK_K))[None, :])
                s = tl.load(scales_ptr + expert.to(tl.int64) * (n_pad * k_pad // 32)
                            + (tl.program_id(1) * (BLOCK_N // 32) + tl.arange(0, BLOCK_N // 32))[:, None] * k_pad
                            + (k0 + tl.arange(0, BLOCK_K))[None, :])
                w = _hopper_unshuffle(_hopper_unpack(w, PTX, INTERPRETED))  # [BLOCK_N, BLOCK_K] bf16
                scale = (_hopper_scales(s, NUM_WARPS).to(tl.uint16) << 7).to(tl.bfloat16, bitcast=True)
                scale = tl.reshape(tl.broadcast_to(scale[:, :, None], (BLOCK_N, BLOCK_K // 32, 32)),
                                   (BLOCK_N, BLOCK_K))
                acc = _dot(_mul(w, scale, INTERPRETED), xt, acc, INTERPRETED)
            else:
                # this K step's tile: [BLOCK_N, BLOCK_K / 2] bytes, then [BLOCK_N, BLOCK_K / 32] scales
                tile = first_tile + k0 // BLOCK_K
                w_tile = blocks_ptr + tile * (BLOCK_N * BLOCK_K // 2)
                within = tl.arange(0, BLOCK_K // 2)
                s = tl.load(scales_ptr + tile * (BLOCK_N * BLOCK_K // 32) + local[:, None] * (BLOCK_K // 32)
                            + tl.arange(0, BLOCK_K // 32)[None, :])
                if UPCAST_BITS:  # [BLOCK_N, BLOCK_K / 2]: a column's bytes along a row
                    w = tl.load(w_tile + local[:, None] * (BLOCK_K // 2) + within[None, :])
                    w = _mxfp4_to_bf16(w, s, BLOCK_N, BLOCK_K, INTERPRETED)  # [BLOCK_N, BLOCK_K] bf16
                    if SWAP:
                        acc = _dot(w, xt, acc, INTERPRETED)
                    else:
                        acc = _dot(x, tl.trans(w), acc, INTERPRETED)
                else:  # [BLOCK_K / 2, BLOCK_N], as tl.dot_scaled takes it
                    w = tl.load(w_tile + local[None, :] * (BLOCK_K // 2) + within[:, None])
                    acc = tl.dot_scaled(x, None, "bf16", w, s, "e2m1", acc, fast_math=True)
        if SWAP:
            acc = tl.trans(acc)
        # transformers: grouped_mm's bf16 output, then `out.add_(bias)` in bf16
        y = _bf16(_bf16(acc) + bias[None, :])
        if SWIGLU:
            gate, up = tl.split(tl.reshape(y, (BLOCK_M, BLOCK_N // 2, 2)))
            gate = tl.minimum(gate, limit)
            up = tl.minimum(tl.maximum(up, -limit), limit)
            glu = _bf16(gate * _bf16(1.0 / (1.0 + tl.exp(-_bf16(gate * alpha)))))
            y = _bf16(_bf16(up + 1.0) * glu)
            half_cols = tl.program_id(1) * (BLOCK_N // 2) + tl.arange(0, BLOCK_N // 2)
            tl.store(out_ptr + rows[:, None].to(tl.int64) * (N // 2) + half_cols[None, :], y,
                     mask=row_ok[:, None] & (half_cols[None, :] < N // 2))
        else:
            dest = rows
            if ROUTED_OUT:
                dest = tl.load(out_rows_ptr + rows, mask=row_ok, other=0)
                y = _bf16(y * tl.load(weight_ptr + dest, mask=row_ok, other=0.0).to(tl.float32)[:, None])
            tl.store(out_ptr + dest[:, None].to(tl.int64) * N + cols[None, :], y,
                     mask=row_ok[:, None] & col_ok[None, :])


@triton.jit
def dequantize_kernel(blocks_ptr, scales_ptr, out_ptr, ROWS, COLS, OUT_KIND: tl.constexpr, HOPPER: tl.constexpr,
                      WARPS: tl.constexpr, TILE_R: tl.constexpr, TILE_C: tl.constexpr, BLOCK_R: tl.constexpr,
                      BLOCK_C: tl.constexpr):
    """out[e, c, r] = FP4(code of value (r, c)) * 2**(scale of (r, c) - 127): the weight [E, ROWS, COLS] written
    transposed, its bytes (two codes, the low nibble the even column) and scales (one a 32-column group) read in
    tile order (mxfp4.to_tile_order: [E, row tiles, column tiles, TILE_R, TILE_C / 2 bytes or / 32 scales]), or
    with HOPPER in the Hopper layout (mxfp4.to_hopper_layout, padded to TILE_R x TILE_C, its scales' layout at
    WARPS warps: [E, rows / 4, 2 cols] and [E, rows / 32, cols]). The checkpoint's own layout is tile order's
    one-tile case, TILE_R = ROWS and TILE_C = COLS.

    HOPPER: a program reads whole pieces of the layout (BLOCK_R a multiple of 32 x WARPS rows, BLOCK_C of 64
    columns), takes each code out of the places mxfp4._hopper_bits put its bits in (_hopper_halves, as the decode
    kernel's unpacking does before its multiply) and undoes the layout's permutations (_hopper_unshuffle,
    _hopper_scales).

    The float32 bits are built with integer arithmetic: FP4 values times a power of two are exact in float32
    (subnormals included), so nothing rounds and no flush-to-zero can change a value; a bf16 result is their
    upper half (OUT_KIND 1), a float32 result the bits themselves (0); 2: converted (other dtypes)."""
    e = tl.program_id(0).to(tl.int64)
    r = tl.program_id(1) * BLOCK_R + tl.arange(0, BLOCK_R)
    c = tl.program_id(2) * BLOCK_C + tl.arange(0, BLOCK_C)
    ok = (c[:, None] < COLS) & (r[None, :] < ROWS)
    if HOPPER:
        rows_pad = (ROWS + TILE_R - 1) // TILE_R * TILE_R
        cols_pad = (COLS + TILE_C - 1) // TILE_C * TILE_C
        VR: tl.constexpr = BLOCK_R // 4  # value rows and bytes of this program's piece
        VC: tl.constexpr = 2 * BLOCK_C
        vr = tl.program_id(1) * VR + tl.arange(0, VR)
        vc = tl.program_id(2) * VC + tl.arange(0, VC)
        # masked: a program's piece may reach past the padded weight (BLOCK_R or BLOCK_C larger than a tile)
        x = tl.load(blocks_ptr + e * rows_pad * (cols_pad // 2) + vr[:, None] * (2 * cols_pad) + vc[None, :],
                    mask=(vr[:, None] < rows_pad // 4) & (vc[None, :] < 2 * cols_pad), other=0)
        halves = _hopper_unshuffle(_hopper_halves(x))  # [BLOCK_R, BLOCK_C]: the value layout undone
        code = tl.trans(((halves >> 12) & 8) | ((halves >> 6) & 7)).to(tl.int32)
        sr = tl.program_id(1) * (BLOCK_R // 32) + tl.arange(0, BLOCK_R // 32)
        sc = tl.program_id(2) * BLOCK_C + tl.arange(0, BLOCK_C)
        s = tl.load(scales_ptr + e * (rows_pad // 32) * cols_pad + sr[:, None] * cols_pad + sc[None, :],
                    mask=(sr[:, None] < rows_pad // 32) & (sc[None, :] < cols_pad), other=127)
        s = _hopper_scales(s.to(tl.int32), WARPS)  # [BLOCK_R, BLOCK_C / 32]: the scale layout undone
        scale = tl.trans(tl.reshape(tl.broadcast_to(s[:, :, None], (BLOCK_R, BLOCK_C // 32, 32)), (BLOCK_R, BLOCK_C)))
    else:
        col_tiles = (COLS + TILE_C - 1) // TILE_C
        tile = (e * ((ROWS + TILE_R - 1) // TILE_R) + r[None, :] // TILE_R) * col_tiles + c[:, None] // TILE_C
        row, col = r[None, :] % TILE_R, c[:, None] % TILE_C
        byte = tl.load(blocks_ptr + tile * (TILE_R * (TILE_C // 2)) + row * (TILE_C // 2) + col // 2,
                       mask=ok, other=0).to(tl.int32)
        code = (byte >> ((c[:, None] % 2) * 4)) & 15
        scale = tl.load(scales_ptr + tile * (TILE_R * (TILE_C // 32)) + row * (TILE_C // 32) + col // 32,
                        mask=ok, other=127).to(tl.int32)
    # E2M1: exponent field f, mantissa bit m; f > 0: (1 + m/2) * 2**(f - 1), f = 0: m * 0.5. Times the scale,
    # the leading bit sits at 2**lead with the fraction bit m (f > 0) or none (f = 0).
    f = (code >> 1) & 3
    m = code & 1
    lead = tl.where(f == 0, scale - 128, f + scale - 128)
    frac = tl.where(f == 0, 0, m)
    normal = ((tl.maximum(lead + 127, 0) << 23) | (frac << 22))
    subnormal = (2 + frac) << tl.minimum(tl.maximum(lead + 148, 0), 29)  # (2 + frac) * 2**(lead - 1)
    bits = tl.where(lead > 127, 0x7F800000, tl.where(lead >= -126, normal, subnormal))
    bits = tl.where((f == 0) & (m == 0), 0, bits) | ((code >> 3) << 31)
    if OUT_KIND == 1:
        value = ((bits >> 16) & 0xFFFF).to(tl.uint16).to(tl.bfloat16, bitcast=True)
    else:
        value = bits.to(tl.float32, bitcast=True)
        if OUT_KIND == 2:
            value = value.to(out_ptr.dtype.element_ty)
    tl.store(out_ptr + e * COLS * ROWS + c[:, None] * ROWS + r[None, :], value, mask=ok)
