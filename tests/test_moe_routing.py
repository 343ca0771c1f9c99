"""moe_routing.py: the one-program Triton routing gives torch's sort/searchsorted/division routing bit for bit (order,
offsets, token_rows: the same values and dtypes), and refuses more rows than its limit (the caller routes those
with torch).

The Triton kernel runs under Triton's interpreter on the CPU (TRITON_INTERPRET=1 while the module is imported): the
same kernel code the GPU compiles; the routing is integer counting, so there is no rounding that could differ there.
"""

import pytest
import torch
from triton_interpreter import interpreted

pytest.importorskip("triton", reason="requirements-test.txt installs triton (its interpreter runs these on CPU)")
pytestmark = pytest.mark.usefixtures("one_torch_thread")


@pytest.fixture(scope="module", autouse=True)
def triton_interpreter():
    """tes_grpo.moe_routing imported under TRITON_INTERPRET=1 for this module's tests."""
    global mr
    with interpreted("tes_grpo.moe_routing") as mr:
        yield


mr = None  # tes_grpo.moe_routing, set by triton_interpreter


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
