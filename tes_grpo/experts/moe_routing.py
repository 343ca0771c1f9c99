"""The MoE decode step's routing (which sorted rows go to which expert) in one Triton program, and the same with the
router's top-k taken in it too (`top_k_route_with_triton`, what a decode step runs on CUDA). Library module, not a
script.

mxfp4_decode's experts kernel takes the T*k routed rows of a decode step sorted by expert: `order` (the stable sort
permutation of the router's flattened expert ids), `offsets` (expert e's rows are order[offsets[e]:offsets[e+1]])
and `token_rows` (the token each sorted row comes from: order // k). `route_with_torch` computes them the way
torch does: a sort, a searchsorted, an arange and a division, each its own launch and the stable radix sort several.
`route_with_triton` computes the same three tensors, bit for bit and with the same dtypes, in one launch of one
program:

    _, scores, indices = mlp.router(x)                        # indices [T, k], expert ids
    order, offsets, token_rows = route_with_triton(indices, experts)

How: each of the n = T*k ids finds its place in the sorted order by counting the ids that sort before it: the smaller
ids, and the equal ids at earlier flattened positions (that tie rule is what makes it the stable sort); offsets[e]
counts the ids below e, as searchsorted does. The counts are row sums of comparison matrices, [n, chunk] and
[E + 1, chunk] (n and E + 1 padded to powers of two), in a loop over chunks of the ids: a whole [n, n] matrix at once
would not fit a thread's registers. Each id then writes its flattened position to order, and position // k to
token_rows, at its place. The places are a permutation of 0..n-1 whatever the ids hold, so every store stays in
bounds, and the outputs equal torch's even for ids outside [0, E) (within int32's range: the kernel compares int32;
the router never gives such ids, and checking would take a host read). The work grows with n squared: up to
MAX_ROWS routed rows (decode: 64 sequences x 4 = 256); beyond that route_with_triton raises ValueError and the
caller routes with torch. No host reads, fixed shapes: CUDA-graph capturable.

Needs Triton on a CUDA device. On CPU the kernel runs under Triton's interpreter (TRITON_INTERPRET=1 while this
module is imported and its kernel runs), which is how tests/test_moe_routing.py checks it without a GPU. As in
mxfp4_decode, the kernel calls only triton.language's builtins, no functions of its standard library (tl.sum
among them: `_row_counts` says how the sums are taken instead).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

MAX_ROWS = 1024  # T*k the kernel takes; its work grows with n squared (n / chunk loop steps of [n, chunk] matrices)
STEP_ELEMENTS = 4096  # a loop step's [n, chunk] matrix, n padded: 16 values a thread at NUM_WARPS, in registers
NUM_WARPS = 8


@triton.jit
def _row_counts(flags):
    """How many of each row's flags are set (int32). This is tl.sum's own arithmetic, written with the builtin
    tl.reduce and triton.language.standard's combine function `_sum_combine` (Triton 3.4 to 3.9): tl.sum is itself a
    @triton.jit function of the standard library, which stays compiled when triton was first imported without the
    interpreter, and an interpreted kernel cannot call it; and the interpreter sums with NumPy only for that combine
    function (with one of this module's, it calls it in Python for every element of the matrix)."""
    return tl.reduce(flags.to(tl.int32), 1, tl.standard._sum_combine)


@triton.jit
def _route_kernel(ids_ptr, order_ptr, offsets_ptr, token_rows_ptr, n, experts, top_k,
                  BLOCK: tl.constexpr, EXPERTS_BLOCK: tl.constexpr, CHUNK: tl.constexpr):
    """For the n flattened expert ids: order[place[i]] = i, token_rows[place[i]] = i // top_k, where place[i] counts
    the ids j with (ids[j], j) < (ids[i], i); offsets[e] (e = 0..experts) counts the ids below e."""
    pos = tl.arange(0, BLOCK)
    valid = pos < n
    ids = tl.load(ids_ptr + pos, mask=valid, other=0).to(tl.int32)  # half the registers of int64 compares
    bins = tl.arange(0, EXPERTS_BLOCK)
    place = tl.full((BLOCK,), 0, tl.int32)
    below = tl.full((EXPERTS_BLOCK,), 0, tl.int32)
    # constexpr bounds, not n: Triton < 3.7's interpreter turns a scalar argument into a range bound with int() on a
    # 1-element array, which NumPy >= 2.4 refuses
    for start in range(0, BLOCK, CHUNK):
        other = start + tl.arange(0, CHUNK)
        other_ok = other < n
        other_ids = tl.load(ids_ptr + other, mask=other_ok, other=0).to(tl.int32)
        before = (other_ids[None, :] < ids[:, None]) | ((other_ids[None, :] == ids[:, None])
                                                        & (other[None, :] < pos[:, None]))
        place += _row_counts(before & other_ok[None, :])
        below += _row_counts((other_ids[None, :] < bins[:, None]) & other_ok[None, :])
    tl.store(order_ptr + place, pos.to(tl.int64), mask=valid)
    tl.store(token_rows_ptr + place, (pos // top_k).to(tl.int64), mask=valid)
    tl.store(offsets_ptr + bins, below.to(tl.int64), mask=bins <= experts)


@triton.jit
def _larger(a, b):
    return tl.maximum(a, b)


@triton.jit
def _smaller(a, b):
    return tl.minimum(a, b)


@triton.jit
def _top_k_route_kernel(logits_ptr, values_ptr, indices_ptr, order_ptr, offsets_ptr, token_rows_ptr, tokens,
                        experts, stride, TOKENS: tl.constexpr, EXPERTS_BLOCK: tl.constexpr, TOP_K: tl.constexpr,
                        K_BLOCK: tl.constexpr):
    """For the router's logits [tokens, experts]: values/indices [tokens, TOP_K] as torch.topk gives them (largest
    first; of equal logits the lower expert id first), and the routing of the flattened ids (route_with_torch's).

    The k experts of a token are distinct, so the stable sort's place of row (t, j) with expert e is offsets[e] (the
    rows of lower experts) plus the earlier tokens routed to e: an exclusive running sum down the tokens of the
    [tokens, experts] matrix of picks, no [rows, rows] comparisons."""
    t = tl.arange(0, TOKENS)
    e = tl.arange(0, EXPERTS_BLOCK)
    kk = tl.arange(0, K_BLOCK)
    t_ok = t < tokens
    v = tl.load(logits_ptr + t[:, None] * stride + e[None, :], mask=t_ok[:, None] & (e < experts)[None, :],
                other=float("-inf")).to(tl.float32)
    picks = tl.full([TOKENS, EXPERTS_BLOCK], 0, tl.int32)
    chosen = tl.full([TOKENS, K_BLOCK], 0, tl.int32)
    open_ = (e < experts)[None, :] & t_ok[:, None]  # experts not yet picked (a picked one never again, even at -inf)
    for j in range(TOP_K):
        best = tl.reduce(tl.where(open_, v, float("-inf")), 1, _larger)
        index = tl.reduce(tl.where(open_ & (v == best[:, None]), e[None, :], EXPERTS_BLOCK), 1, _smaller)
        tl.store(values_ptr + t * TOP_K + j, best.to(values_ptr.dtype.element_ty), mask=t_ok)
        tl.store(indices_ptr + t * TOP_K + j, index.to(tl.int64), mask=t_ok)
        hit = e[None, :] == index[:, None]
        picks += (hit & t_ok[:, None]).to(tl.int32)
        chosen = tl.where(kk[None, :] == j, index[:, None], chosen)
        open_ = open_ & ~hit
    earlier = tl.associative_scan(picks, 0, tl.standard._sum_combine) - picks  # earlier tokens' rows, per expert
    counts = tl.reduce(picks, 0, tl.standard._sum_combine)
    offsets = tl.associative_scan(counts, 0, tl.standard._sum_combine) - counts
    tl.store(offsets_ptr + e, offsets.to(tl.int64), mask=e < experts)
    tl.store(offsets_ptr + experts, tl.reduce(counts, 0, tl.standard._sum_combine).to(tl.int64))  # every row
    starts = earlier + offsets[None, :]
    for j in range(TOP_K):
        index = tl.reduce(tl.where(kk[None, :] == j, chosen, 0), 1, tl.standard._sum_combine)
        place = tl.reduce(tl.where(e[None, :] == index[:, None], starts, 0), 1, tl.standard._sum_combine)
        tl.store(order_ptr + place, (t * TOP_K + j).to(tl.int64), mask=t_ok)
        tl.store(token_rows_ptr + place, t.to(tl.int64), mask=t_ok)


def route_with_torch(indices: torch.Tensor, experts: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(order, offsets, token_rows) of the router's expert ids [T, k] over `experts` experts, from torch's sort,
    searchsorted and division (int64 each): the reference route_with_triton equals."""
    top_k = indices.shape[-1]
    sorted_ids, order = torch.sort(indices.reshape(-1), stable=True)
    offsets = torch.searchsorted(sorted_ids, torch.arange(experts + 1, device=indices.device, dtype=sorted_ids.dtype))
    token_rows = torch.div(order, top_k, rounding_mode="floor")
    return order, offsets, token_rows


def route_with_triton(indices: torch.Tensor, experts: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """route_with_torch's three tensors, the same bit for bit, from one launch of `_route_kernel`. indices [T, k]:
    integer expert ids (int32's range) with T*k <= MAX_ROWS (ValueError beyond: route those with torch)."""
    if indices.dim() != 2 or indices.dtype.is_floating_point or indices.dtype.is_complex:
        raise ValueError(f"route_with_triton: indices must be integer expert ids [tokens, k], got "
                         f"{tuple(indices.shape)} {indices.dtype}")
    tokens, top_k = indices.shape
    rows = tokens * top_k
    if rows > MAX_ROWS:
        raise ValueError(f"route_with_triton: {tokens} tokens x {top_k} experts = {rows} routed rows, more than its "
                         f"limit of MAX_ROWS = {MAX_ROWS} (its work grows with the rows squared); "
                         f"route these with route_with_torch")
    if experts < 1:
        raise ValueError(f"route_with_triton: needs at least one expert, got experts={experts}")
    device = indices.device
    order = torch.empty(rows, dtype=torch.int64, device=device)
    token_rows = torch.empty(rows, dtype=torch.int64, device=device)
    offsets = torch.empty(experts + 1, dtype=torch.int64, device=device)
    block = max(16, triton.next_power_of_2(rows))
    _route_kernel[(1,)](indices.reshape(-1).contiguous(), order, offsets, token_rows, rows, experts, top_k,
                        BLOCK=block, EXPERTS_BLOCK=triton.next_power_of_2(experts + 1),
                        CHUNK=min(block, STEP_ELEMENTS // block), num_warps=NUM_WARPS)
    return order, offsets, token_rows


def top_k_route_with_torch(logits: torch.Tensor, top_k: int):
    """(values, indices, order, offsets, token_rows): torch.topk of the router's logits [T, E] (as gpt-oss's router
    takes it) and route_with_torch of its indices: the reference top_k_route_with_triton equals."""
    values, indices = torch.topk(logits, top_k, dim=-1)
    return (values, indices, *route_with_torch(indices, logits.shape[-1]))


def top_k_route_with_triton(logits: torch.Tensor, top_k: int):
    """top_k_route_with_torch's five tensors from one launch of one program: the top-k of each token's logits and
    the routing of its experts. The same as torch's where a token's logits have no ties among its k largest (values
    and indices bit for bit; order, offsets and token_rows follow from the indices); of equal logits this takes the
    lower expert id first, where torch.topk's order of equal values is its own (on the CPU, not the lower id first).
    logits [T, E] float without NaN (torch.topk ranks NaN first; this kernel's maximum skips it), T x top_k <=
    MAX_ROWS (ValueError beyond: route with torch)."""
    if logits.dim() != 2 or not logits.dtype.is_floating_point:
        raise ValueError(f"top_k_route_with_triton: logits must be float [tokens, experts], got "
                         f"{tuple(logits.shape)} {logits.dtype}")
    tokens, experts = logits.shape
    if not 1 <= top_k <= experts:
        raise ValueError(f"top_k_route_with_triton: top_k={top_k} must be between 1 and the {experts} experts")
    rows = tokens * top_k
    if rows > MAX_ROWS:
        raise ValueError(f"top_k_route_with_triton: {tokens} tokens x {top_k} experts = {rows} routed rows, more "
                         f"than its limit of MAX_ROWS = {MAX_ROWS}; route these with top_k_route_with_torch")
    device = logits.device
    logits = logits if logits.stride(-1) == 1 else logits.contiguous()
    values = torch.empty(tokens, top_k, dtype=logits.dtype, device=device)
    indices = torch.empty(tokens, top_k, dtype=torch.int64, device=device)
    order = torch.empty(rows, dtype=torch.int64, device=device)
    token_rows = torch.empty(rows, dtype=torch.int64, device=device)
    offsets = torch.empty(experts + 1, dtype=torch.int64, device=device)
    if tokens:
        _top_k_route_kernel[(1,)](logits, values, indices, order, offsets, token_rows, tokens, experts,
                                  logits.stride(0), TOKENS=max(16, triton.next_power_of_2(tokens)),
                                  EXPERTS_BLOCK=max(16, triton.next_power_of_2(experts)), TOP_K=top_k,
                                  K_BLOCK=triton.next_power_of_2(top_k), num_warps=4)
    else:
        offsets.zero_()
    return values, indices, order, offsets, token_rows
