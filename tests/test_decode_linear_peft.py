"""decode_linear.py's kernel (under Triton's interpreter) against PEFT's own lora.Linear forward under bf16 autocast,
at LoRA scalings that are not a power of two, so the kernel multiplies by the scaling itself (HAS_SCALE) rather than
taking it folded into B: the kernel's other tests compare it with its own reference(), which would follow the kernel
if both took the scaling wrong. Small integers, so every float32 sum is exact and the results agree bit for bit."""

import pytest
import torch
from triton_interpreter import interpreted, runtime_loops

pytest.importorskip("triton", reason="requirements-test.txt installs triton (its interpreter runs these on CPU)")
pytestmark = pytest.mark.usefixtures("one_torch_thread")

BF16 = torch.bfloat16
SIZES = (40, 24, 24)  # q, k and v in small, read from the same rows
K = 200  # not a whole number of BLOCK_K blocks
SMALL_TILES = (16, 64, 4, 1)  # (BLOCK_N, BLOCK_K, warps, stages): small tiles keep the interpreter quick
# the kernel's `range(0, K, BLOCK_K)`: where Triton's interpreter cannot run it (the GPU machine's Triton 3.6 under
# NumPy 2.5), CI's stack (Triton 3.9) checks the unfolded scaling; on CUDA only the recipe's folded one is checked
runs_kernel = runtime_loops("CI's stack (Triton 3.9) runs this check; on CUDA tests/gpu_cuda_test.py checks the "
                            "compiled kernel at the recipe's scaling (2, folded into B)")


@pytest.fixture(scope="module")
def dl():
    with interpreted("tes_grpo.sampling.decode_linear") as module:
        yield module


class Projections(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.q, self.k, self.v = (torch.nn.Linear(K, n) for n in SIZES)


def integers(g, *shape, low=-8, high=8):
    return torch.randint(low, high + 1, shape, generator=g).float()


def peft_projections(rank: int, alpha: float, rslora: bool, seed: int = 0):
    """q, k and v as PEFT's lora.Linear with integer weights, biases and factors."""
    from peft import LoraConfig, get_peft_model

    g = torch.Generator().manual_seed(seed)
    config = LoraConfig(r=rank, lora_alpha=alpha, use_rslora=rslora, lora_dropout=0.0, target_modules=["q", "k", "v"],
                        init_lora_weights=False)
    model = get_peft_model(Projections(), config).base_model.model
    with torch.no_grad():
        for layer in (model.q, model.k, model.v):
            base = layer.base_layer
            base.weight.copy_(integers(g, *base.weight.shape))
            base.bias.copy_(integers(g, *base.bias.shape, low=-64, high=64))
            for factor in (layer.lora_A["default"].weight, layer.lora_B["default"].weight):
                factor.copy_(integers(g, *factor.shape))
    return model.eval()


@runs_kernel
@pytest.mark.parametrize("rank, alpha, rslora, scaling", [
    (4, 6, False, 1.5),  # alpha / r
    (4, 5, True, 2.5),  # rsLoRA: alpha / sqrt(r)
])
def test_kernel_equals_peft_lora_linear_at_an_unfolded_scaling(dl, rank, alpha, rslora, scaling):
    model = peft_projections(rank, alpha, rslora)
    layers = (model.q, model.k, model.v)
    assert [layer.scaling["default"] for layer in layers] == [scaling] * 3  # not a power of two: not folded into B
    x = integers(torch.Generator().manual_seed(1), 6, 1, K).to(BF16)
    with torch.no_grad(), torch.autocast("cpu", dtype=BF16):
        expected = torch.cat([layer(x) for layer in layers], dim=-1)
    assert expected.dtype == BF16
    weights = [layer.base_layer.weight.detach().to(BF16) for layer in layers]
    bias = torch.cat([layer.base_layer.bias.detach() for layer in layers]).to(BF16)
    a = torch.cat([layer.lora_A["default"].weight.detach() for layer in layers]).to(BF16)
    b = torch.block_diag(*[layer.lora_B["default"].weight.detach() for layer in layers]).to(BF16).contiguous()
    got = dl.linear(x, weights, bias, (a, b, scaling), tiles=SMALL_TILES)
    assert torch.equal(got, expected), f"{int((got != expected).sum())} of {got.numel()} differ"
    # the scaling matters here: without it (or at twice it) the adapter's part comes out other bits
    for other in (1.0, 2 * scaling):
        assert not torch.equal(dl.linear(x, weights, bias, (a, b, other), tiles=SMALL_TILES), expected), other
