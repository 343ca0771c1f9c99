"""One-query attention over a decode step's KV cache as one Triton kernel (flash decoding), what graph_decode's decode
steps attend with on CUDA (decode_math.attention_function). Library module, not a script; imported only where
Triton is installed.

Same contract as decode_math.flex_decode_kernel, which decoded before: attention without the sinks, returning the
output in the query's dtype and the float32 log-sum-exp, so that the sink step after it (decode_glue.with_sinks)
stays the training forward's. The arithmetic is flex attention's: the scores q.k in float32 from the bf16 operands,
times the scaling, plus the additive mask, a running maximum and sum in float32 over blocks of slots (base-2
exponentials), the probabilities rounded to the values' dtype for the product with the values, the sums in float32.

Why not flex attention's decoding kernel: inside a decode step it read the cache at 1.27-1.52 TB/s on an H100
(BENCHMARKS.md), and it reads every slot of the full layers' 512-slot bucket. Here one program takes one sequence's
key-value head (its query heads are the rows of one product, so each key and value is read once), loops over the
slots with the loads pipelined, and stops at `seen`: the slots the step's token may see (its own slot + 1), read
from the device, so a captured step reads no slot past it. Left padding before it is read like any slot (the mask
gives it no weight; GRPO's prompts differ by a few dozen tokens). When sequences x key-value heads leave the GPU's
multiprocessors idle, each sequence's slots are cut into parts read side by side and combined after
(combine_kernel), as flex attention does.

On the CPU the same kernels run under Triton's interpreter (TRITON_INTERPRET=1 when this module is imported), which
is how the tests check them. The interpreter rounds float32 to bf16 by truncation (Triton 3.9) where a GPU rounds to
nearest, so the CPU tests bound the error instead of asserting bits. The kernels call only triton.language's
builtins (tl.full, not tl.zeros; tl.reduce with this module's own maximum and sum, not tl.max and tl.sum): its
standard library was compiled when triton was first imported, without the interpreter.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from tes_grpo.triton_support import interpreted

BLOCK_N = 64  # cache slots a program reads per loop step
NUM_WARPS = 4  # warps a program
NUM_STAGES = 3  # loop steps whose loads are in flight at once
ROWS = 16  # a program's query rows: its key-value head's query heads, padded to the 16 rows a tensor-core product takes


@triton.jit
def _larger(a, b):
    return tl.maximum(a, b)


@triton.jit
def _plus(a, b):
    return a + b


@triton.jit
def _dot(a, b, acc, INTERPRETED: tl.constexpr):
    """tl.dot(a, b, acc) of bf16 tiles with float32 sums. Triton's interpreter (3.9) keeps bf16 tensors as their
    uint16 bits and would multiply the bits, so interpreted the tiles are widened to float32 first (exact products, as
    the tensor cores' bf16 products are)."""
    if INTERPRETED:
        a = a.to(tl.float32)
        b = b.to(tl.float32)
    return tl.dot(a, b, acc)


@triton.jit
def attention_kernel(Q, K, V, Mask, Seen, Out, Lse, PartAcc, PartMax, PartSum, length, scale, per_split,
                     sq_b, sq_h, sk_b, sk_h, sk_l, sv_b, sv_h, sv_l, sm_b,
                     KV_HEADS: tl.constexpr, GROUP: tl.constexpr, ROWS: tl.constexpr, DIM: tl.constexpr,
                     DIM_PAD: tl.constexpr, BLOCK_N: tl.constexpr, HAS_SEEN: tl.constexpr, FINAL: tl.constexpr,
                     INTERPRETED: tl.constexpr):
    """Program (sequence x key-value head, part): its query heads against slots [part x per_split, + per_split) of
    the first min(seen, length). FINAL (one part): the output and log-sum-exp; else the part's float32 sums, maximum
    and sum of exponentials (base 2) for combine_kernel."""
    pid = tl.program_id(0)
    part = tl.program_id(1)
    b = (pid // KV_HEADS).to(tl.int64)  # b x a sequence's stride passes int32 at B x KV x L x D >= 2^31
    kv = pid % KV_HEADS
    rows = tl.arange(0, ROWS)
    dims = tl.arange(0, DIM_PAD)
    row_ok = rows < GROUP
    dim_ok = dims < DIM
    heads = kv * GROUP + rows
    q = tl.load(Q + b * sq_b + heads[:, None] * sq_h + dims[None, :], mask=row_ok[:, None] & dim_ok[None, :],
                other=0.0)
    end = length
    if HAS_SEEN:
        end = tl.minimum(tl.load(Seen).to(tl.int32), length)
    first = part * per_split
    last = tl.minimum(first + per_split, end)
    k_base = K + b * sk_b + kv * sk_h
    v_base = V + b * sv_b + kv * sv_h
    run_max = tl.full([ROWS], float("-inf"), tl.float32)
    run_sum = tl.full([ROWS], 0.0, tl.float32)
    acc = tl.full([ROWS, DIM_PAD], 0.0, tl.float32)
    for start in range(first, last, BLOCK_N):
        cols = start + tl.arange(0, BLOCK_N)
        col_ok = cols < last
        add = tl.load(Mask + b * sm_b + cols, mask=col_ok, other=float("-inf"))
        kv_ok = col_ok[:, None] & dim_ok[None, :]
        k = tl.load(k_base + cols[:, None] * sk_l + dims[None, :], mask=kv_ok, other=0.0)
        v = tl.load(v_base + cols[:, None] * sv_l + dims[None, :], mask=kv_ok, other=0.0)
        zero = tl.full([ROWS, BLOCK_N], 0.0, tl.float32)
        scores = (_dot(q, tl.trans(k), zero, INTERPRETED) * scale + add[None, :]) * 1.4426950408889634
        new_max = tl.maximum(run_max, tl.reduce(scores, 1, _larger))
        # a row that has seen only masked slots keeps a maximum of -inf; 0 stands in for it (its exponentials are 0)
        pivot = tl.where(new_max == float("-inf"), 0.0, new_max)
        rescale = tl.exp2(run_max - pivot)
        p = tl.exp2(scores - pivot[:, None])
        run_sum = run_sum * rescale + tl.reduce(p, 1, _plus)
        acc = _dot(p.to(v.dtype), v, acc * rescale[:, None], INTERPRETED)
        run_max = new_max
    if FINAL:
        out = acc / tl.where(run_sum == 0.0, 1.0, run_sum)[:, None]
        out_rows = b * (KV_HEADS * GROUP) + heads
        tl.store(Out + out_rows[:, None] * DIM + dims[None, :], out.to(Out.dtype.element_ty),
                 mask=row_ok[:, None] & dim_ok[None, :])
        tl.store(Lse + out_rows, (run_max + tl.log2(run_sum)) * 0.6931471805599453, mask=row_ok)
    else:
        parts = tl.num_programs(1)
        at = (b * (KV_HEADS * GROUP) + heads) * parts + part
        tl.store(PartAcc + at[:, None] * DIM_PAD + dims[None, :], acc, mask=row_ok[:, None])
        tl.store(PartMax + at, run_max, mask=row_ok)
        tl.store(PartSum + at, run_sum, mask=row_ok)


@triton.jit
def combine_kernel(PartAcc, PartMax, PartSum, Out, Lse, parts, DIM: tl.constexpr, DIM_PAD: tl.constexpr):
    """Program (sequence x query head): its parts' sums rescaled to their common maximum, the output and the
    log-sum-exp (parts that saw no slot have a maximum of -inf and add nothing)."""
    row = tl.program_id(0)
    dims = tl.arange(0, DIM_PAD)
    total_max = tl.load(PartMax + row * parts)
    for part in range(1, parts):
        total_max = tl.maximum(total_max, tl.load(PartMax + row * parts + part))
    pivot = tl.where(total_max == float("-inf"), 0.0, total_max)
    weight = tl.exp2(tl.load(PartMax + row * parts) - pivot)
    total = weight * tl.load(PartSum + row * parts)
    acc = weight * tl.load(PartAcc + row * parts * DIM_PAD + dims)
    for part in range(1, parts):
        weight = tl.exp2(tl.load(PartMax + row * parts + part) - pivot)
        total += weight * tl.load(PartSum + row * parts + part)
        acc += weight * tl.load(PartAcc + (row * parts + part) * DIM_PAD + dims)
    out = acc / tl.where(total == 0.0, 1.0, total)
    tl.store(Out + row * DIM + dims, out.to(Out.dtype.element_ty), mask=dims < DIM)
    tl.store(Lse + row, (total_max + tl.log2(total)) * 0.6931471805599453)


def parts_for(programs: int, blocks: int, processors: int) -> int:
    """Into how many parts each sequence's slots are cut: enough that the programs (sequences x key-value heads x
    parts) reach twice the GPU's multiprocessors, as flex attention's decoding kernel counts, but no more parts
    than slot blocks. One part where the programs already fill the GPU (64 sequences x 8 heads on an H100)."""
    return max(1, min(-(-2 * processors // programs), blocks))


def attention(query: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, mask: torch.Tensor, scaling: float,
              seen: torch.Tensor | None = None, parts: int | None = None,
              tiles: tuple[int, int, int] | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """gpt-oss's one-query attention without the sinks: (output [B, H, 1, D] in the query's dtype, float32
    log-sum-exp [B, H, 1]). query [B, H, 1, D]; keys, values [B, KV, L, D] (views of longer buffers allowed: the
    last dimension contiguous); mask [B, L] additive float32; seen: 0-d integer device tensor, the number of leading
    slots any row may see (the mask masks the rest; they are not read), None = all L. parts: see parts_for (None:
    parts_for this GPU; the tests set it). tiles: (slots a loop step, warps, stages), default (BLOCK_N, NUM_WARPS,
    NUM_STAGES) (the benchmark sweeps them). A row that sees no slot gets 0 and a log-sum-exp of -inf."""
    batch, heads, queries, dim = query.shape
    kv_heads, length = keys.shape[1], keys.shape[2]
    if queries != 1 or heads % kv_heads or values.shape != keys.shape or mask.shape != (batch, length):
        raise ValueError(f"decode_attention: query {tuple(query.shape)}, keys {tuple(keys.shape)}, values "
                         f"{tuple(values.shape)}, mask {tuple(mask.shape)}: expected one query and [B, KV, L, D] "
                         "keys and values with a [B, L] mask, the heads a multiple of the key-value heads")
    group = heads // kv_heads
    if group > ROWS:
        raise ValueError(f"decode_attention: {group} query heads a key-value head; the kernel takes up to {ROWS}")
    query = query if query.stride(-1) == 1 else query.contiguous()
    keys = keys if keys.stride(-1) == 1 else keys.contiguous()
    values = values if values.stride(-1) == 1 else values.contiguous()
    mask = mask if mask.stride(-1) == 1 and mask.dtype == torch.float32 else mask.float().contiguous()
    block_n, warps, stages = tiles or (BLOCK_N, NUM_WARPS, NUM_STAGES)
    blocks = -(-length // block_n)
    if parts is None:
        processors = (torch.cuda.get_device_properties(query.device).multi_processor_count
                      if query.device.type == "cuda" else 1)
        parts = parts_for(batch * kv_heads, blocks, processors)
    per_split = -(-blocks // parts) * block_n
    out = torch.empty(batch, heads, 1, dim, dtype=query.dtype, device=query.device)
    lse = torch.empty(batch, heads, 1, dtype=torch.float32, device=query.device)
    dim_pad = triton.next_power_of_2(max(dim, 16))
    final = parts == 1
    if final:
        part_acc = part_max = part_sum = lse  # unused: one part writes the result itself
    else:
        part_acc = torch.empty(batch * heads * parts, dim_pad, dtype=torch.float32, device=query.device)
        part_max = torch.empty(batch * heads * parts, dtype=torch.float32, device=query.device)
        part_sum = torch.empty_like(part_max)
    attention_kernel[(batch * kv_heads, parts)](
        query, keys, values, mask, seen if seen is not None else lse, out, lse, part_acc, part_max, part_sum,
        length, scaling, per_split, query.stride(0), query.stride(1), keys.stride(0), keys.stride(1),
        keys.stride(2), values.stride(0), values.stride(1), values.stride(2), mask.stride(0),
        KV_HEADS=kv_heads, GROUP=group, ROWS=ROWS, DIM=dim, DIM_PAD=dim_pad, BLOCK_N=block_n,
        HAS_SEEN=seen is not None, FINAL=final, INTERPRETED=interpreted(attention_kernel), num_warps=warps,
        num_stages=stages)
    if not final:
        combine_kernel[(batch * heads,)](part_acc, part_max, part_sum, out, lse, parts, DIM=dim, DIM_PAD=dim_pad)
    return out, lse
