"""The attention projections of a decode step, with the LoRA adapter's output added in PEFT's order, as one Triton
kernel: what graph_decode's decode steps compute q, k, v and o with on CUDA (decode_math.Projections). Library
module, not a script; imported only where Triton is installed.

`linear` computes, for a few rows x and one or more weights W_j that read the same x (q_proj, k_proj and v_proj):

    y = bf16(bf16(x @ W^T + bias) + bf16(bf16(bf16(x @ A^T) @ B^T) * scaling))

into one [rows, sum of outputs] tensor, W the W_j one after another (each read through its own pointer: no
concatenated copy). That is PEFT 0.21's lora.Linear.forward under the trainer's bf16 autocast, rounding for rounding:
the base layer's product with its bias rounded once (cuBLAS adds the bias before rounding), the adapter's two
products each rounded, the scaling's product rounded (none when it is a power of two folded into B: the same
numbers), the sum rounded. A and B are layers/lora.py's LowRank's: the projections' A stacked, their B block-diagonal.
The sums are float32 in another order than cuBLAS's, as another cuBLAS kernel's would be (the trainer's forward runs
other shapes, so other kernels).

Why: a decode step multiplies 64 rows by each weight, so the time is reading the weights. cuBLAS takes q, k and v
as three products (k and v split along K with a reduction kernel each), and the adapter adds two products, a scaling
and an add, each a kernel of a few microseconds that reads next to nothing (BENCHMARKS.md counts them). Here one
program set reads each weight tile once for all rows, keeps float32 sums along the whole of K (no partial sums to
write and add: cutting K into shares read side by side, with a second kernel to add them, did not pay at gpt-oss's
shapes; BENCHMARKS.md), takes x @ A^T along the way, and finishes its tile: bias, roundings, the adapter's second
product, the add.
The tile width is chosen so that the programs come near the GPU's multiprocessors (block_n_for).

On the CPU the same kernel runs under Triton's interpreter (TRITON_INTERPRET=1 when this module is imported), which
is how the tests check them. Roundings to bf16 are done on the bits (_bf16), the same on both, so a CPU test with
sums that are exact in float32 checks every rounding bit for bit. The kernel calls only triton.language's builtins:
its standard library was compiled when triton was first imported, without the interpreter.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from tes_grpo.triton_support import interpreted

BLOCK_M = 64  # rows a program multiplies (fewer rows: the next power of two, at least 16)
BLOCK_N = 64  # output features a program computes (32 where 64 would leave most multiprocessors idle: block_n_for)
BLOCK_K = 128  # input features a loop step reads
NUM_WARPS = 4  # warps a program
NUM_STAGES = 4  # loop steps whose loads are in flight at once
MAX_WEIGHTS = 3  # weights one call reads the same rows for (q, k, v)


@triton.jit
def _bf16(x):
    """float32 -> the nearest bf16 (ties to even), kept in float32; on the bits, because Triton's interpreter (3.9)
    truncates in `.to(tl.bfloat16)`. NaN stays NaN (rounding its bits could carry it into inf)."""
    bits = x.to(tl.uint32, bitcast=True)
    bits = (bits + 0x7FFF + ((bits >> 16) & 1)) & 0xFFFF0000
    return tl.where(x != x, x, bits.to(tl.float32, bitcast=True))


@triton.jit
def _dot(a, b, acc, INTERPRETED: tl.constexpr):
    """tl.dot(a, b, acc) of bf16 tiles with float32 sums; interpreted, the tiles are widened first (Triton 3.9's
    interpreter would multiply a bf16 tile's bits as integers)."""
    if INTERPRETED:
        a = a.to(tl.float32)
        b = b.to(tl.float32)
    return tl.dot(a, b, acc)


@triton.jit
def _finish(total, low, rows, row_ok, cols, col_ok, Out, Bias, B, N, scale, RANK: tl.constexpr,
            RANK_PAD: tl.constexpr, HAS_BIAS: tl.constexpr, HAS_LORA: tl.constexpr, HAS_SCALE: tl.constexpr,
            BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, INTERPRETED: tl.constexpr):
    """Stores bf16(bf16(total + bias) + bf16(bf16(bf16(low) @ B^T) * scale)) for rows x cols of Out [M, N]: total
    [BLOCK_M, BLOCK_N] the float32 sums of x @ W^T, low [BLOCK_M, RANK_PAD] those of x @ A^T."""
    if HAS_BIAS:
        total = total + tl.load(Bias + cols, mask=col_ok, other=0.0).to(tl.float32)[None, :]
    y = _bf16(total)
    if HAS_LORA:
        ranks = tl.arange(0, RANK_PAD)
        b = tl.load(B + cols[None, :] * RANK + ranks[:, None], mask=col_ok[None, :] & (ranks[:, None] < RANK),
                    other=0.0)  # B^T [RANK_PAD, BLOCK_N]
        extra = _bf16(_dot(_bf16(low).to(tl.bfloat16), b, tl.full((BLOCK_M, BLOCK_N), 0.0, tl.float32),
                           INTERPRETED))
        if HAS_SCALE:
            extra = _bf16(extra * scale)
        y = _bf16(y + extra)
    tl.store(Out + rows[:, None].to(tl.int64) * N + cols[None, :], y.to(tl.bfloat16),
             mask=row_ok[:, None] & col_ok[None, :])


@triton.jit
def linear_kernel(X, W0, W1, W2, A, Out, Bias, B, M, K, N, N0, N1, N2, tiles0, tiles1, scale, stride_x,
                  RANK: tl.constexpr, RANK_PAD: tl.constexpr, HAS_BIAS: tl.constexpr, HAS_LORA: tl.constexpr,
                  HAS_SCALE: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                  INTERPRETED: tl.constexpr):
    """Program (row block, output tile): BLOCK_M rows times BLOCK_N outputs of one weight (tiles0 tiles of W0, then
    tiles1 of W1, then W2's), stored at that weight's columns of Out [M, N]: the float32 sums of x @ W^T and of
    x @ A^T over the whole of K, then _finish."""
    rows = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    tile = tl.program_id(1)
    row_ok = rows < M
    second = tile >= tiles0
    third = tile >= tiles0 + tiles1
    offset = tl.where(third, N0 + N1, tl.where(second, N0, 0))  # the weight's first column in Out
    n = tl.where(third, N2, tl.where(second, N1, N0))
    first = (tile - tl.where(third, tiles0 + tiles1, tl.where(second, tiles0, 0))) * BLOCK_N
    if third:
        w = W2
    elif second:
        w = W1
    else:
        w = W0
    local = first + tl.arange(0, BLOCK_N)
    local_ok = local < n
    ranks = tl.arange(0, RANK_PAD)
    acc = tl.full((BLOCK_M, BLOCK_N), 0.0, tl.float32)
    low = tl.full((BLOCK_M, RANK_PAD), 0.0, tl.float32)
    for k0 in range(0, K, BLOCK_K):
        ks = k0 + tl.arange(0, BLOCK_K)
        k_ok = ks < K
        x = tl.load(X + rows[:, None].to(tl.int64) * stride_x + ks[None, :], mask=row_ok[:, None] & k_ok[None, :],
                    other=0.0)
        wt = tl.load(w + local[None, :].to(tl.int64) * K + ks[:, None], mask=local_ok[None, :] & k_ok[:, None],
                     other=0.0)  # W^T [BLOCK_K, BLOCK_N]
        acc = _dot(x, wt, acc, INTERPRETED)
        if HAS_LORA:
            at = tl.load(A + ranks[None, :] * K + ks[:, None], mask=(ranks[None, :] < RANK) & k_ok[:, None],
                         other=0.0)  # A^T [BLOCK_K, RANK_PAD]
            low = _dot(x, at, low, INTERPRETED)
    _finish(acc, low, rows, row_ok, offset + local, local_ok, Out, Bias, B, N, scale, RANK, RANK_PAD, HAS_BIAS,
            HAS_LORA, HAS_SCALE, BLOCK_M, BLOCK_N, INTERPRETED)


def block_n_for(sizes: list[int], processors: int) -> int:
    """Output features a program computes: BLOCK_N, or half of it where BLOCK_N-wide tiles would leave more than half
    the multiprocessors idle (gpt-oss's o_proj: 45 tiles of 64 on an H100's 132), and 16 at the least."""
    block_n = BLOCK_N
    while block_n > 16 and 2 * sum(-(-size // block_n) for size in sizes) < processors:
        block_n //= 2
    return block_n


def block_m_for(rows: int) -> int:
    """Rows a program multiplies: BLOCK_M, or for fewer rows the next power of two (tensor-core products take 16)."""
    return min(BLOCK_M, max(16, triton.next_power_of_2(rows)))


def linear(x: torch.Tensor, weights: list[torch.Tensor], bias: torch.Tensor | None = None,
           lora: tuple[torch.Tensor, torch.Tensor, float | None] | None = None,
           tiles: tuple[int, int, int, int] | None = None) -> torch.Tensor:
    """x [..., K] bf16 times each of `weights` ([N_j, K] bf16, contiguous; up to MAX_WEIGHTS), their outputs side by
    side: [..., sum N_j] bf16, as the module docstring computes it (PEFT 0.21's lora.Linear.forward under bf16
    autocast). bias: [sum N_j] (the weights' biases one after another) or None. lora: (A [R, K], B [sum N_j, R],
    scaling or None) in bf16, or None (no adapter). tiles: (BLOCK_N, BLOCK_K, warps, stages), default (block_n_for
    this GPU, BLOCK_K, NUM_WARPS, NUM_STAGES) (the benchmark sweeps them; the tests set them)."""
    if not 1 <= len(weights) <= MAX_WEIGHTS:
        raise ValueError(f"decode_linear: {len(weights)} weights; one call takes 1 to {MAX_WEIGHTS}")
    k = x.shape[-1]
    tensors = [x, *weights] + ([bias] if bias is not None else []) + (list(lora[:2]) if lora is not None else [])
    if any(t.dtype != torch.bfloat16 or t.device != x.device for t in tensors):
        raise ValueError("decode_linear: x, weights, bias and LoRA factors must be bf16 on one device, got "
                         + ", ".join(f"{t.dtype} on {t.device}" for t in tensors))
    if any(w.dim() != 2 or w.shape[1] != k or not w.is_contiguous() for w in weights):
        raise ValueError(f"decode_linear: weights must be contiguous [N, {k}], got "
                         + ", ".join(str(tuple(w.shape)) for w in weights))
    sizes = [w.shape[0] for w in weights] + [0] * (MAX_WEIGHTS - len(weights))
    n = sum(sizes)
    if bias is not None and tuple(bias.shape) != (n,):
        raise ValueError(f"decode_linear: bias {tuple(bias.shape)}, expected ({n},)")
    rank = 0
    if lora is not None:
        a, b, scale = lora
        rank = a.shape[0]
        if a.shape != (rank, k) or b.shape != (n, rank) or not a.is_contiguous() or not b.is_contiguous():
            raise ValueError(f"decode_linear: LoRA A {tuple(a.shape)}, B {tuple(b.shape)}: expected contiguous "
                             f"[R, {k}] and [{n}, R]")
    else:
        a, b, scale = x, x, None  # unused: no adapter
    rows = x.reshape(-1, k)
    rows = rows if rows.stride(-1) == 1 else rows.contiguous()
    m = rows.shape[0]
    if tiles is None:
        processors = (torch.cuda.get_device_properties(x.device).multi_processor_count
                      if x.device.type == "cuda" else 1)
        tiles = (block_n_for(sizes, processors), BLOCK_K, NUM_WARPS, NUM_STAGES)
    block_n, block_k, warps, stages = tiles
    if any(v < 16 or v & (v - 1) for v in (block_n, block_k)):
        raise ValueError(f"decode_linear: tiles {tiles}: BLOCK_N and BLOCK_K must be powers of two of at least 16")
    block_m = block_m_for(m)
    tile_counts = [-(-size // block_n) for size in sizes]
    out = torch.empty(m, n, dtype=torch.bfloat16, device=x.device)
    linear_kernel[(-(-m // block_m), sum(tile_counts))](
        rows, *(weights + [weights[0]] * (MAX_WEIGHTS - len(weights))), a, out, bias if bias is not None else out, b,
        m, k, n, *sizes, tile_counts[0], tile_counts[1], 1.0 if scale is None else float(scale), rows.stride(0),
        RANK=rank, RANK_PAD=max(16, triton.next_power_of_2(max(rank, 1))), HAS_BIAS=bias is not None,
        HAS_LORA=lora is not None, HAS_SCALE=scale is not None, BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=block_k,
        INTERPRETED=interpreted(linear_kernel), num_warps=warps, num_stages=stages)
    return out.view(*x.shape[:-1], n)


def _rounded(t: torch.Tensor) -> torch.Tensor:
    return t.to(torch.bfloat16).double()


def reference(x: torch.Tensor, weights: list[torch.Tensor], bias: torch.Tensor | None = None,
              lora: tuple[torch.Tensor, torch.Tensor, float | None] | None = None,
              bias_after_rounding: bool = False) -> torch.Tensor:
    """What `linear` computes, in float64 with torch (the sums exact, each rounding of the module docstring's formula
    a bf16 round to nearest): the tests' and the benchmark's yardstick, on any device. bias_after_rounding: the bias
    added after the base product's rounding instead (the rounding cuBLAS's bias epilogue does not do), to show which
    of the two a result follows."""
    y = x.double() @ torch.cat(weights).double().T
    if bias is not None:
        y = _rounded(y) + bias.double() if bias_after_rounding else y + bias.double()
    y = _rounded(y)
    if lora is not None:
        a, b, scale = lora
        extra = _rounded(_rounded(x.double() @ a.double().T) @ b.double().T)
        if scale is not None:
            extra = _rounded(extra * scale)
        y = _rounded(y + extra)
    return y.to(torch.bfloat16)
