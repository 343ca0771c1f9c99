"""moe_routing.py: the one-program Triton routing gives torch's sort/searchsorted/division routing bit for bit (order,
offsets, token_rows: the same values and dtypes), and refuses more rows than its limit (the caller routes those
with torch).

The Triton kernel runs under Triton's interpreter on the CPU (TRITON_INTERPRET=1 while the module is imported): the
same kernel code the GPU compiles; the routing is integer counting, so there is no rounding that could differ there.
"""

import re

import pytest
import torch
from triton_interpreter import interpreted

pytest.importorskip("triton", reason="requirements-test.txt installs triton (its interpreter runs these on CPU)")
pytestmark = pytest.mark.usefixtures("one_torch_thread")


@pytest.fixture(scope="module", autouse=True)
def triton_interpreter():
    """tes_grpo.experts.moe_routing imported under TRITON_INTERPRET=1 for this module's tests."""
    global mr
    with interpreted("tes_grpo.experts.moe_routing") as mr:
        yield


mr = None  # tes_grpo.experts.moe_routing, set by triton_interpreter


def router(tokens, k, experts, generator):
    """Expert ids as gpt-oss's router gives them: k distinct experts a token, by descending score, int64."""
    return torch.rand(tokens, experts, generator=generator).topk(k, dim=-1).indices


def uniform(low, high):
    """Ids drawn independently from [low, high): repeats within a token too."""
    return lambda tokens, k, experts, generator: torch.randint(low, high, (tokens, k), generator=generator)


def only(*hit):
    """Ids drawn independently from the experts `hit` (the others get no rows)."""
    return lambda tokens, k, experts, generator: torch.tensor(hit)[uniform(0, len(hit))(tokens, k, experts, generator)]


# (tokens, k, experts, ids from (tokens, k, experts, generator))
CASES = [
    (64, 4, 32, router),  # gpt-oss-20b's decode step: 64 sequences, top-4 of 32 experts
    (64, 4, 32, only(5)),  # every row to one expert: one 256-long tie
    (16, 4, 8, only(1, 2, 4, 5, 6)),  # experts 0, 3 and 7 never hit: empty ranges at the start, middle and end
    (1, 4, 32, router),  # one token
    (3, 4, 32, router),  # 12 rows, not a power of two: padded to the 16-row block
    (37, 4, 32, router),  # 148 rows, not a power of two: the last chunks lie partly or wholly past the end
    (64, 4, 128, router),  # gpt-oss-120b: 128 experts (offsets padded to 256)
    (256, 4, 32, router),  # 1024 rows: MAX_ROWS exactly, the smallest chunk
    (200, 1, 4, uniform(0, 4)),  # k = 1: token_rows = order; long ties
    (16, 4, 32, lambda t, k, e, g: router(t, k, e, g).int()),  # int32 ids
    (8, 4, 4, uniform(-3, 8)),  # ids outside [0, 4) (the router gives none): torch's answer all the same
    (0, 4, 32, router),  # no tokens: order empty, offsets all zero
]


@pytest.mark.parametrize("tokens, k, experts, make_ids", CASES)
def test_triton_routing_equals_torch_bit_for_bit(tokens, k, experts, make_ids):
    ids = make_ids(tokens, k, experts, torch.Generator().manual_seed(0))
    ours = mr.route_with_triton(ids, experts)
    reference = mr.route_with_torch(ids, experts)
    for name, got, expected in zip(("order", "offsets", "token_rows"), ours, reference, strict=True):
        assert got.dtype == expected.dtype, name
        assert torch.equal(got, expected), (name, got, expected)


def test_both_give_the_stable_order_worked_by_hand():
    ids = torch.tensor([[2, 0], [0, 2], [1, 0]])  # flattened: 2 0 0 2 1 0
    expected = (torch.tensor([1, 2, 5, 4, 0, 3]),  # the 0s at positions 1, 2, 5 in that order, then the 1, the 2s
                torch.tensor([0, 3, 4, 6, 6]),  # expert 3: an empty range at the end
                torch.tensor([0, 1, 2, 2, 0, 1]))  # position // 2
    for route in (mr.route_with_torch, mr.route_with_triton):
        for got, want in zip(route(ids, 4), expected, strict=True):
            assert torch.equal(got, want), (route.__name__, got, want)


@pytest.mark.parametrize("tokens, k", [
    (1025, 1),  # MAX_ROWS + 1
    (257, 4),  # a decode step of 257 sequences
])
def test_more_rows_than_the_limit_are_refused(tokens, k):
    with pytest.raises(ValueError, match=rf"{tokens * k} routed rows, more than its limit of MAX_ROWS = 1024"):
        mr.route_with_triton(torch.zeros(tokens, k, dtype=torch.int64), 32)


def distinct_logits(tokens, experts, generator, dtype=torch.bfloat16):
    """Router logits with no two equal in a row (a random permutation of spaced values): torch.topk's order is then
    the only one."""
    ranks = torch.stack([torch.randperm(experts, generator=generator) for _ in range(tokens)]) if tokens else \
        torch.zeros(0, experts, dtype=torch.int64)
    return ((ranks.float() - experts / 2) / 4).to(dtype)


# (tokens, experts, top_k, dtype): the router's top-k and the routing from one program against torch.topk and
# route_with_torch, logits without ties
FUSED_CASES = [
    (64, 32, 4, torch.bfloat16),  # gpt-oss-20b's decode step
    (64, 128, 4, torch.bfloat16),  # gpt-oss-120b's 128 experts
    (37, 32, 4, torch.bfloat16),  # tokens not a power of two
    (1, 32, 4, torch.float32),  # one token, float32 logits (the CPU's dtype)
    (5, 8, 8, torch.float32),  # every expert picked: k = experts
    (200, 4, 1, torch.bfloat16),  # k = 1
    (0, 32, 4, torch.bfloat16),  # no tokens
]


@pytest.mark.parametrize("tokens, experts, top_k, dtype", FUSED_CASES)
def test_fused_top_k_and_routing_equal_torch_bit_for_bit(tokens, experts, top_k, dtype):
    logits = distinct_logits(tokens, experts, torch.Generator().manual_seed(0), dtype)
    ours = mr.top_k_route_with_triton(logits, top_k)
    reference = mr.top_k_route_with_torch(logits, top_k)
    for name, got, expected in zip(("values", "indices", "order", "offsets", "token_rows"), ours, reference,
                                   strict=True):
        assert got.dtype == expected.dtype, name
        assert torch.equal(got, expected), (name, got, expected)


def test_fused_top_k_takes_the_lower_expert_first_among_equal_logits():
    logits = torch.tensor([[1.0, 3.0, 3.0, 2.0, 3.0, 0.0],  # three equal largest: experts 1, 2, then 4
                           [0.0, 0.0, 0.0, 0.0, 0.0, 0.0]])  # all equal: experts 0, 1, 2, 3
    values, indices, order, offsets, token_rows = mr.top_k_route_with_triton(logits, 4)
    assert torch.equal(indices, torch.tensor([[1, 2, 4, 3], [0, 1, 2, 3]]))
    assert torch.equal(values, torch.tensor([[3.0, 3.0, 3.0, 2.0], [0.0, 0.0, 0.0, 0.0]]))
    # the routing of those ids is route_with_torch's
    for got, expected in zip((order, offsets, token_rows), mr.route_with_torch(indices, 6), strict=True):
        assert torch.equal(got, expected)


@pytest.mark.parametrize("shape, top_k, message", [
    ((257, 32), 4, "1028 routed rows, more than its limit"),  # past MAX_ROWS
    ((4, 8), 9, "top_k=9 must be between 1 and the 8 experts"),  # more picks than experts
    ((4, 8, 2), 2, "logits must be float [tokens, experts]"),  # not a matrix
])
def test_the_fused_routing_refuses_what_it_cannot_take(shape, top_k, message):
    with pytest.raises(ValueError, match=re.escape(message)):
        mr.top_k_route_with_triton(torch.zeros(shape), top_k)


def test_the_fused_top_k_picks_distinct_experts_past_minus_infinity():
    # fewer finite logits than k: the rest are picked among the -inf ones, each expert once (a permutation follows)
    logits = torch.tensor([[float("-inf"), 2.0, float("-inf"), float("-inf")]])
    values, indices, order, offsets, token_rows = mr.top_k_route_with_triton(logits, 3)
    assert torch.equal(indices, torch.tensor([[1, 0, 2]]))
    assert torch.equal(order.sort().values, torch.arange(3))
    assert torch.equal(offsets, torch.tensor([0, 1, 2, 3, 3]))
