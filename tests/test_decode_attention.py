"""decode_attention.py's kernel under Triton's interpreter: gpt-oss's one-query attention against a float64 reference,
the slots past `seen` never read, the parts combined, and the launcher's checks. The compiled kernel is checked on
CUDA in tests/gpu_cuda_test.py against the same reference and flex attention's kernel."""

import re

import pytest
import torch
from triton_interpreter import interpreted, runtime_loops

from tes_grpo.sampling import decode_math

pytest.importorskip("triton", reason="requirements-test.txt installs triton (its interpreter runs these on CPU)")
pytestmark = [
    pytest.mark.usefixtures("one_torch_thread"),
    # a masked slot's score (the mask's float32 minimum) times log2(e) overflows to -inf, as on a GPU: the exponential
    # the kernel takes of it is exactly 0 (NumPy warns of the overflow)
    pytest.mark.filterwarnings("ignore:overflow encountered in multiply:RuntimeWarning"),
]

MASKED = torch.finfo(torch.float32).min  # decode_cache's masked value
# the kernel's `range(first, last, BLOCK_N)`: where Triton's interpreter cannot run it, the compiled kernel is checked
runs_kernel = runtime_loops("the compiled kernel is checked against the same float64 reference and flex attention "
                            "on CUDA in tests/gpu_cuda_test.py")


@pytest.fixture(scope="module", autouse=True)
def triton_interpreter():
    global da
    with interpreted("tes_grpo.sampling.decode_attention") as module:
        da = module
        yield


da = None  # tes_grpo.sampling.decode_attention, set by triton_interpreter


def inputs(batch, heads, kv_heads, dim, length, padded=0, seed=0, spare=7):
    """query [B, H, 1, D]; keys, values [B, KV, L, D] as views of longer buffers (as the cache gives them); an
    additive mask [B, L] with the first `padded` slots of every other row masked (left padding)."""
    g = torch.Generator().manual_seed(seed)
    query = torch.randn(batch, heads, 1, dim, generator=g).to(torch.bfloat16)
    keys, values = (torch.randn(batch, kv_heads, length + spare, dim, generator=g).to(torch.bfloat16)[:, :, :length]
                    for _ in range(2))
    mask = torch.zeros(batch, length)
    mask[1::2, :padded] = MASKED
    return query, keys, values, mask


def reference(query, keys, values, mask, scaling, seen=None):
    """(output, log-sum-exp) in float64, each query head on its key-value head (grouped-query attention)."""
    group = query.shape[1] // keys.shape[1]
    keys, values = (t.double().repeat_interleave(group, dim=1) for t in (keys, values))
    scores = query.double() @ keys.transpose(-1, -2) * scaling + mask.double()[:, None, None, :]
    if seen is not None:
        scores[..., seen:] = float("-inf")
    return torch.softmax(scores, dim=-1) @ values, torch.logsumexp(scores, dim=-1)


# (batch, query heads, key-value heads, head dim, cache length, left padding, parts, seen): the kernel's output and
# log-sum-exp against the float64 reference
CASES = [
    (3, 8, 2, 16, 40, 0, 1, None),  # one slot block, part of it past the cache
    (2, 64, 8, 64, 200, 40, 1, None),  # gpt-oss's heads and head dim, left padding in every other row
    (2, 64, 8, 64, 200, 40, 1, 131),  # only the first 131 slots seen (a full layer's bucket past the token)
    (3, 8, 2, 16, 300, 100, 1, None),  # a whole slot block of left padding before any slot a row sees
    (3, 8, 2, 16, 300, 20, 3, None),  # each row's slots in 3 parts, combined
    (2, 4, 1, 24, 70, 0, 2, 65),  # a head dim the kernel pads (24 of 32), 4 heads a key-value head, 2 parts
    (2, 8, 2, 16, 300, 0, 4, 30),  # 4 parts of which only the first sees a slot
    (1, 2, 1, 16, 1, 0, 1, None),  # a single slot
]


@runs_kernel
@pytest.mark.parametrize("batch, heads, kv_heads, dim, length, padded, parts, seen", CASES)
def test_attention_matches_the_reference(batch, heads, kv_heads, dim, length, padded, parts, seen):
    query, keys, values, mask = inputs(batch, heads, kv_heads, dim, length, padded)
    if seen is not None:
        mask[:, seen:] = MASKED  # what decode_cache's mask says of the slots past the token
    out, lse = da.attention(query, keys, values, mask, 0.25, None if seen is None else torch.tensor(seen),
                            parts=parts)
    exact_out, exact_lse = reference(query, keys, values, mask, 0.25, seen)
    assert out.shape == (batch, heads, 1, dim) and out.dtype == torch.bfloat16
    assert lse.shape == (batch, heads, 1) and lse.dtype == torch.float32
    assert (lse.double() - exact_lse).abs().max() < 1e-5  # float32 sums
    # the probabilities are rounded to bf16 for the product with the values, the output to bf16 (the interpreter
    # truncates both: Triton 3.9)
    assert (out.double() - exact_out).abs().max() <= exact_out.abs().max() * 2 ** -6


@runs_kernel
@pytest.mark.parametrize("parts", [1, 3])
def test_slots_past_seen_are_not_read(parts):
    query, keys, values, mask = inputs(2, 8, 2, 16, 200, padded=10, spare=0)
    seen = 77
    mask[:, seen:] = MASKED
    out, lse = da.attention(query, keys, values, mask, 0.25, torch.tensor(seen), parts=parts)
    for t in (keys, values):
        t[:, :, seen:] = float("nan")  # a slot read past `seen` would make every output it reaches NaN
    unread = da.attention(query, keys, values, mask, 0.25, torch.tensor(seen), parts=parts)
    assert torch.equal(unread[0], out) and torch.equal(unread[1], lse)


@runs_kernel
def test_masked_slots_add_nothing():
    # a masked slot's exponential is exactly 0 and leaves the running maximum alone, so reading the masked slots past
    # `seen` gives the same bits as not reading them
    query, keys, values, mask = inputs(2, 8, 2, 16, 200, padded=10)
    mask[:, 90:] = MASKED
    read = da.attention(query, keys, values, mask, 0.25, None, parts=1)
    skipped = da.attention(query, keys, values, mask, 0.25, torch.tensor(90), parts=1)
    assert torch.equal(read[0], skipped[0]) and torch.equal(read[1], skipped[1])


@runs_kernel
def test_with_sinks_matches_one_query_attention():
    # the kernel under the sink step, as a GPU decodes: the same bound as flex attention's (test_graph_decode.py)
    query, keys, values, mask = inputs(3, 8, 2, 16, 300, padded=60)
    sinks = torch.randn(8, generator=torch.Generator().manual_seed(1)).to(torch.bfloat16)
    exact = decode_math.one_query_attention(*(t.double() for t in (query, keys, values, mask, sinks)), 0.25)
    ours = decode_math.attention_with_sinks(query, keys, values, mask, sinks, 0.25, kernel=da.attention)
    assert ours.shape == exact.shape == (3, 1, 8 * 16) and ours.dtype == torch.bfloat16
    assert (ours.double() - exact).abs().max() <= exact.abs().max() * 2 ** -5


# (sequences x key-value heads, slot blocks, multiprocessors, parts): cut only while the programs leave the GPU idle
PARTS = [
    (512, 32, 132, 1),  # 64 sequences x 8 heads on an H100: one part
    (64, 32, 132, 5),  # 8 sequences: ceil(264 / 64) parts
    (8, 32, 132, 32),  # one sequence: as many parts as slot blocks, no more
    (8, 2, 132, 2),  # a short cache: 2 blocks, 2 parts
    (300, 10, 132, 1),  # more programs than multiprocessors
]


@pytest.mark.parametrize("programs, blocks, processors, parts", PARTS)
def test_parts_for(programs, blocks, processors, parts):
    assert da.parts_for(programs, blocks, processors) == parts


# (query shape, keys shape, mask shape, message)
REFUSED = [
    ((2, 8, 2, 16), (2, 2, 40, 16), (2, 40), "one query"),  # two queries a row
    ((2, 6, 1, 16), (2, 4, 40, 16), (2, 40), "multiple of the key-value heads"),  # 6 heads over 4
    ((2, 8, 1, 16), (2, 2, 40, 16), (2, 41), "a [B, L] mask"),  # mask of another length
    ((2, 64, 1, 16), (2, 2, 40, 16), (2, 40), "up to 16"),  # 32 heads a key-value head
]


@pytest.mark.parametrize("query_shape, keys_shape, mask_shape, message", REFUSED)
def test_refuses_shapes_it_cannot_take(query_shape, keys_shape, mask_shape, message):
    query, keys = torch.zeros(query_shape, dtype=torch.bfloat16), torch.zeros(keys_shape, dtype=torch.bfloat16)
    with pytest.raises(ValueError, match=re.escape(message)):
        da.attention(query, keys, keys, torch.zeros(mask_shape), 0.25)
