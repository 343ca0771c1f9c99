"""decode_linear.py's kernel under Triton's interpreter: the base products, the bias and the LoRA adapter's output in
PEFT's order, rounding for rounding, against a float64 reference; the tile choices; the launcher's checks.
The compiled kernels are checked on CUDA in tests/gpu_cuda_test.py against cuBLAS under the trainer's autocast."""

import pytest
import torch
from triton_interpreter import interpreted, runtime_loops

pytest.importorskip("triton", reason="requirements-test.txt installs triton (its interpreter runs these on CPU)")
pytestmark = pytest.mark.usefixtures("one_torch_thread")

BF16 = torch.bfloat16
# the kernel's `range(0, K, BLOCK_K)`: where Triton's interpreter cannot run it, the compiled kernel is checked
runs_kernel = runtime_loops("the compiled kernel is checked against PEFT's rounding and the exact sums on CUDA in "
                            "tests/gpu_cuda_test.py")
SMALL_TILES = (16, 64, 4, 1)  # (BLOCK_N, BLOCK_K, warps, stages): small tiles keep the interpreter quick


@pytest.fixture(scope="module", autouse=True)
def triton_interpreter():
    global dl
    with interpreted("tes_grpo.sampling.decode_linear") as module:
        dl = module
        yield


dl = None  # tes_grpo.sampling.decode_linear, set by triton_interpreter


def integers(g, *shape, low=-8, high=8):
    """bf16 tensor of small integers: every float32 sum of their products is exact, so the only roundings are the
    bf16 ones the formula names, and a kernel that skips or moves one gives other bits."""
    return torch.randint(low, high + 1, shape, generator=g).to(BF16)


def case(seed, rows, sizes, k, rank, scale, with_bias=True, values=integers):
    g = torch.Generator().manual_seed(seed)
    x = values(g, rows, 1, k)
    weights = [values(g, n, k) for n in sizes]
    bias = values(g, sum(sizes), low=-64, high=64) if with_bias else None
    lora = None
    if rank:
        a = values(g, rank * len(sizes), k)
        b = torch.block_diag(*[values(g, n, rank) for n in sizes]).contiguous()
        lora = (a, b, scale)
    return x, weights, bias, lora


@runs_kernel
@pytest.mark.parametrize("rows, sizes, k, rank, scale, with_bias", [
    (6, (40, 24, 24), 200, 4, None, True),   # q, k, v in small, the scaling folded into B; K not whole blocks
    (6, (40, 24, 24), 200, 4, 1.5, True),    # a scaling that is not a power of two: its own rounding
    (20, (48,), 130, 4, None, True),         # o_proj: one weight; rows past one 16-row block
    (3, (32,), 200, 0, None, True),          # no adapter
    (5, (24, 8), 64, 2, 0.5, False),         # no bias; K in one block
    (70, (24, 16), 64, 2, None, True),       # more rows than a program's 64: a second row block
    (4, (24,), 64, 2, 0.0, True),            # a scaling of 0 (lora_alpha 0): the adapter adds nothing
])
def test_kernel_rounds_as_peft_bit_for_bit(rows, sizes, k, rank, scale, with_bias):
    x, weights, bias, lora = case(0, rows, sizes, k, rank, scale, with_bias)
    got = dl.linear(x, weights, bias, lora, tiles=SMALL_TILES)
    expected = dl.reference(x.reshape(rows, k), weights, bias, lora).view(rows, 1, -1)
    assert got.shape == expected.shape and got.dtype == BF16
    assert torch.equal(got, expected), (got != expected).sum()


@runs_kernel
def test_rows_read_through_their_stride():
    # x as a view whose rows are further apart than K (a slice of a wider buffer): each row read at its own start
    x, weights, bias, lora = case(2, 6, (40, 24, 24), 200, 4, None)
    wide = torch.cat([x, integers(torch.Generator().manual_seed(3), 6, 1, 56)], dim=-1)[..., :200]
    assert not wide.is_contiguous() and torch.equal(wide, x)
    got = dl.linear(wide, weights, bias, lora, tiles=SMALL_TILES)
    assert torch.equal(got, dl.linear(x, weights, bias, lora, tiles=SMALL_TILES))
    assert torch.equal(got.view(6, -1), dl.reference(x.reshape(6, 200), weights, bias, lora))


def test_every_rounding_is_needed_for_the_reference():
    # the integer cases above must be ones where each rounding changes bits, else the bit-for-bit test could not see
    # a skipped one: leave each out of the reference in turn and the numbers differ
    x, weights, bias, (a, b, _) = case(0, 6, (40, 24, 24), 200, 4, None)
    x = x.reshape(6, 200)
    exact = x.double() @ torch.cat(weights).double().T + bias.double()
    low = x.double() @ a.double().T
    assert not torch.equal(exact, exact.to(BF16).double())
    assert not torch.equal(low, low.to(BF16).double())
    extra = low.to(BF16).double() @ b.double().T
    assert not torch.equal(extra, extra.to(BF16).double())
    total = exact.to(BF16).double() + extra.to(BF16).double()
    assert not torch.equal(total, total.to(BF16).double())
    scaled = extra.to(BF16).double() * 1.5
    assert not torch.equal(scaled, scaled.to(BF16).double())


def gaussian(g, *shape, low=None, high=None):
    return (torch.randn(*shape, generator=g) * 0.05).to(BF16)


@runs_kernel
def test_float_inputs_within_one_rounding_of_the_exact_sums():
    # random values: the float32 sums are not exact, so a bf16 rounding may land one ulp away from the exact sum's on
    # a value near a rounding boundary, and no further
    x, weights, bias, lora = case(1, 6, (40, 24, 24), 256, 4, 2.0, values=gaussian)
    got = dl.linear(x, weights, bias, lora, tiles=SMALL_TILES).reshape(6, -1).float()
    expected = dl.reference(x.reshape(6, 256), weights, bias, lora).float()
    ulp = torch.finfo(BF16).eps * expected.abs().clamp(min=1e-3)
    assert bool(((got - expected).abs() <= 2 * ulp).all())
    assert float((got != expected).float().mean()) < 0.02


@pytest.mark.parametrize("sizes, processors, expected", [
    ((4096, 512, 512), 132, 64),  # gpt-oss's q, k, v on an H100: 80 tiles of 64
    ((2880,), 132, 32),           # its o_proj: 45 tiles of 64 would leave most of the 132 idle, 90 of 32 do not
    ((32,), 132, 16),             # a narrow product: 16 at the least
    ((2880,), 1, 64),             # the interpreter's one "processor"
])
def test_block_n_for(sizes, processors, expected):
    assert dl.block_n_for(list(sizes), processors) == expected


@pytest.mark.parametrize("rows, expected", [(1, 16), (6, 16), (17, 32), (64, 64), (256, 64)])
def test_block_m_for(rows, expected):
    assert dl.block_m_for(rows) == expected


@pytest.mark.parametrize("change, words", [
    (dict(x=torch.zeros(2, 8)), "must be bf16"),                               # float32 rows
    (dict(weights=[torch.zeros(4, 6, dtype=BF16)]), "contiguous [N, 8]"),      # K differs
    (dict(weights=[torch.zeros(8, 4, dtype=BF16).T]), "contiguous [N, 8]"),    # not contiguous
    (dict(weights=[torch.zeros(4, 8, dtype=BF16)] * 4), "1 to 3"),             # four weights
    (dict(bias=torch.zeros(5, dtype=BF16)), "bias (5,), expected (4,)"),        # bias of the wrong length
    (dict(lora=(torch.zeros(2, 8, dtype=BF16), torch.zeros(4, 3, dtype=BF16), None)), "LoRA A (2, 8), B (4, 3)"),
    (dict(tiles=(24, 64, 4, 1)), "powers of two of at least 16"),             # a tile Triton cannot take
])
def test_bad_arguments_are_refused(change, words):
    args = dict(x=torch.zeros(2, 8, dtype=BF16), weights=[torch.zeros(4, 8, dtype=BF16)], bias=None, lora=None,
                tiles=None)
    args.update(change)
    with pytest.raises(ValueError, match=words.replace("[", r"\[").replace("(", r"\(").replace(")", r"\)")):
        dl.linear(args["x"], args["weights"], args["bias"], args["lora"], tiles=args["tiles"])


def test_the_reference_can_add_the_bias_after_the_rounding():
    # the benchmark's second yardstick: bf16(bf16(x @ W^T) + bias), which the integer case tells from one rounding
    x, weights, bias, _ = case(4, 6, (40,), 200, 0, None)
    rows = x.reshape(6, 200)
    after = (rows.double() @ weights[0].double().T).to(BF16).double() + bias.double()
    assert torch.equal(dl.reference(rows, weights, bias, bias_after_rounding=True), after.to(BF16))
    assert not torch.equal(dl.reference(rows, weights, bias), after.to(BF16))
