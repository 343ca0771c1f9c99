"""A decode step's sampled tokens and their log-probabilities in three Triton launches, what token_sampling.draw
runs on CUDA. Library module, not a script; imported only where Triton is installed.

torch.multinomial(softmax(s), 1) draws one sample as argmax_i p_i / q_i with q ~ Exp(1) drawn by
`torch.empty_like(p).exponential_()` (ATen's multinomial for one sample, torch 2.11-2.13; tests/test_draw_kernel.py
checks it on the torch at hand). Here q comes from that same call on the scores' shape, so the random numbers drawn
and the generator's state after are torch.multinomial's, and generate()'s. The kernels then read the scores twice
and q once, where torch's path (softmax, the multinomial's checks, exponential, division, argmax, and the recorded
log-probability's logsumexp and gather) launches a kernel for each operation and reads the vocabulary in most of
them (BENCHMARKS.md times both):
- max_kernel: each (row, chunk) program's largest score;
- pick_kernel: with the row's maximum m from those, its chunk's sum of e_i = exp(s_i - m) and its first largest
  e_i / q_i (p_i / q_i times the row's constant sum, so the same argmax);
- finish_kernel: per row, the chunk with the largest quotient (the first of equal ones), the token, and its
  log-probability s_c - m - log(sum e), the log_softmax that torch.logsumexp gives.
The token is torch's unless two candidates' quotients lie within a few float32 roundings of each other (the
exponentials and the sum are computed in another order and with Triton's exp): the same distribution, and a draw
that differs from torch's only at such a near tie (none in the draws tests/gpu_cuda_test.py compares). The scores
must be finite or -inf (what the warpers mask): torch's multinomial stops on NaN or +inf; these kernels do not check.

On the CPU the same kernels run under Triton's interpreter (TRITON_INTERPRET=1 when this module is imported), which
is how the tests check them. The kernels call only triton.language's builtins (tl.reduce with this module's combine
functions, not tl.max or tl.sum), and loop over constant ranges only: the interpreters before Triton 3.7 cannot loop
over a runtime value under NumPy 2.4 or newer (tests/triton_interpreter.py).
"""

from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl

BLOCK = 2048  # scores a program reads per loop step
PROGRAMS_PER_PROCESSOR = 4  # chunks per row: enough that rows x chunks reach this many programs a multiprocessor
MAX_CHUNKS = 64  # at most this many chunks per row (finish_kernel reads them all at once)


@triton.jit
def _larger(a, b):
    return tl.maximum(a, b)


@triton.jit
def _smaller(a, b):
    return tl.minimum(a, b)


@triton.jit
def _plus(a, b):
    return a + b


@triton.jit
def max_kernel(scores_ptr, part_max_ptr, vocab, row_stride, CHUNKS: tl.constexpr, CHUNK: tl.constexpr,
               BLOCK: tl.constexpr):
    """Program (row, chunk): the largest of the row's scores [chunk x CHUNK, + CHUNK) -> part_max[row, chunk]."""
    row = tl.program_id(0).to(tl.int64)
    chunk = tl.program_id(1)
    best = tl.full([BLOCK], float("-inf"), tl.float32)
    for start in range(0, CHUNK, BLOCK):
        cols = chunk * CHUNK + start + tl.arange(0, BLOCK)
        s = tl.load(scores_ptr + row * row_stride + cols, mask=cols < vocab, other=float("-inf")).to(tl.float32)
        best = tl.maximum(best, s)
    tl.store(part_max_ptr + row * CHUNKS + chunk, tl.reduce(best, 0, _larger))


@triton.jit
def pick_kernel(scores_ptr, noise_ptr, part_max_ptr, part_sum_ptr, part_best_ptr, part_index_ptr, vocab, row_stride,
                noise_stride, CHUNKS: tl.constexpr, CHUNKS_PAD: tl.constexpr, CHUNK: tl.constexpr,
                BLOCK: tl.constexpr):
    """Program (row, chunk): with m the row's largest score (all of part_max's chunks), the chunk's sum of
    exp(s - m) -> part_sum, and its largest exp(s - m) / q and the first column that has it -> part_best,
    part_index."""
    row = tl.program_id(0).to(tl.int64)
    chunk = tl.program_id(1)
    parts = tl.arange(0, CHUNKS_PAD)
    top = tl.reduce(tl.load(part_max_ptr + row * CHUNKS + parts, mask=parts < CHUNKS, other=float("-inf")), 0,
                    _larger)
    total = tl.full([BLOCK], 0.0, tl.float32)
    best = tl.full([BLOCK], -1.0, tl.float32)
    best_col = tl.full([BLOCK], 0, tl.int32)
    for start in range(0, CHUNK, BLOCK):
        cols = chunk * CHUNK + start + tl.arange(0, BLOCK)
        ok = cols < vocab
        s = tl.load(scores_ptr + row * row_stride + cols, mask=ok, other=float("-inf")).to(tl.float32)
        q = tl.load(noise_ptr + row * noise_stride + cols, mask=ok, other=1.0)
        e = tl.exp(s - top)
        total += e
        ratio = tl.where(ok, tl.math.div_rn(e, q), -1.0)
        better = ratio > best  # strictly: a lane keeps its first column of equal quotients
        best = tl.where(better, ratio, best)
        best_col = tl.where(better, cols, best_col)
    chunk_best = tl.reduce(best, 0, _larger)
    first = tl.reduce(tl.where(best == chunk_best, best_col, 2147483647), 0, _smaller)
    at = row * CHUNKS + chunk
    tl.store(part_sum_ptr + at, tl.reduce(total, 0, _plus))
    tl.store(part_best_ptr + at, chunk_best)
    tl.store(part_index_ptr + at, first)


@triton.jit
def finish_kernel(scores_ptr, part_max_ptr, part_sum_ptr, part_best_ptr, part_index_ptr, chosen_ptr, logprob_ptr,
                  row_stride, CHUNKS: tl.constexpr, CHUNKS_PAD: tl.constexpr):
    """Program (row): the token (the first column of the largest quotient over the chunks) -> chosen[row], and its
    log-probability s_c - m - log(sum of the chunks' sums) -> logprob[row]."""
    row = tl.program_id(0).to(tl.int64)
    parts = tl.arange(0, CHUNKS_PAD)
    inside = parts < CHUNKS
    at = row * CHUNKS + parts
    top = tl.reduce(tl.load(part_max_ptr + at, mask=inside, other=float("-inf")), 0, _larger)
    total = tl.reduce(tl.load(part_sum_ptr + at, mask=inside, other=0.0), 0, _plus)
    best = tl.load(part_best_ptr + at, mask=inside, other=-2.0)
    index = tl.load(part_index_ptr + at, mask=inside, other=2147483647)
    chosen = tl.reduce(tl.where(best == tl.reduce(best, 0, _larger), index, 2147483647), 0, _smaller)
    score = tl.load(scores_ptr + row * row_stride + chosen).to(tl.float32)
    tl.store(chosen_ptr + row, chosen.to(tl.int64))
    tl.store(logprob_ptr + row, score - top - tl.log(total))


@functools.cache
def _processors(device_index: int) -> int:
    return torch.cuda.get_device_properties(device_index).multi_processor_count


def chunks_for(rows: int, vocab: int, processors: int) -> int:
    """Chunks a row's vocabulary is cut into: enough that rows x chunks reach PROGRAMS_PER_PROCESSOR programs a
    multiprocessor, a power of two, at most MAX_CHUNKS and at most the power of two at or above the vocabulary's
    BLOCK-sized pieces. draw gives each chunk a whole number of blocks, so the last chunks can be short or empty (64
    rows on an H100 or H200: 16 chunks of 14,336 of gpt-oss's 201,088 tokens, the 15th 384, the 16th empty)."""
    wanted = -(-PROGRAMS_PER_PROCESSOR * processors // max(rows, 1))
    return max(1, min(triton.next_power_of_2(wanted), MAX_CHUNKS, triton.next_power_of_2(-(-vocab // BLOCK))))


def draw(scores: torch.Tensor, noise: torch.Tensor | None = None, chunks: int | None = None,
         block: int = BLOCK) -> tuple[torch.Tensor, torch.Tensor]:
    """(each row's token [B] int64, its log-probability [B] float32) for scores [B, vocab] float32, the last
    dimension contiguous, as token_sampling.draw's torch.multinomial(softmax(scores), 1) and log_softmax give them
    (bf16 scores are widened, with float32 noise where torch would draw bf16 noise for them). noise: q [B, vocab]
    float32 (default: drawn here as torch.multinomial draws it, from the default generator of the scores' device; the
    tests pass their own). chunks: see chunks_for (None: chunks_for this GPU). block: scores a program reads per loop
    step, a power of two (the tests shrink it for tiny vocabularies)."""
    rows, vocab = scores.shape
    scores = scores if scores.stride(-1) == 1 else scores.contiguous()
    if noise is None:
        noise = torch.empty(scores.shape, dtype=torch.float32, device=scores.device).exponential_()
    elif noise.shape != scores.shape or noise.dtype != torch.float32 or noise.stride(-1) != 1:
        raise ValueError(f"draw_kernel.draw: noise {tuple(noise.shape)} {noise.dtype} must be float32 of the scores' "
                         f"shape {tuple(scores.shape)}, the last dimension contiguous")
    if chunks is None:
        processors = _processors(scores.device.index or 0) if scores.is_cuda else 1
        chunks = chunks_for(rows, vocab, processors)
    chunk = -(-vocab // (chunks * block)) * block
    chunks_pad = max(triton.next_power_of_2(chunks), 2)
    part_max = torch.empty(rows, chunks, dtype=torch.float32, device=scores.device)
    part_sum = torch.empty_like(part_max)
    part_best = torch.empty_like(part_max)
    part_index = torch.empty(rows, chunks, dtype=torch.int32, device=scores.device)
    chosen = torch.empty(rows, dtype=torch.int64, device=scores.device)
    logprob = torch.empty(rows, dtype=torch.float32, device=scores.device)
    max_kernel[(rows, chunks)](scores, part_max, vocab, scores.stride(0), CHUNKS=chunks, CHUNK=chunk, BLOCK=block)
    pick_kernel[(rows, chunks)](scores, noise, part_max, part_sum, part_best, part_index, vocab, scores.stride(0),
                                noise.stride(0), CHUNKS=chunks, CHUNKS_PAD=chunks_pad, CHUNK=chunk, BLOCK=block)
    finish_kernel[(rows,)](scores, part_max, part_sum, part_best, part_index, chosen, logprob, scores.stride(0),
                           CHUNKS=chunks, CHUNKS_PAD=chunks_pad)
    return chosen, logprob
