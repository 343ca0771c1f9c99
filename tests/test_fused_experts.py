"""fused_experts.py: the training experts give transformers' grouped_mm forward bit for bit and its gradients, take
the fused path only when grad is on, and refuse what they cannot differentiate.

On CPU the fused functions run eagerly (the GPU compiles the same functions); the slow test compiles them with
inductor's CPU backend to check that compiling keeps the forward's bf16 roundings.
"""

import pytest
import torch
from transformers import GptOssConfig, GptOssForCausalLM
from transformers.integrations.moe import grouped_mm_experts_forward
from transformers.models.gpt_oss.modeling_gpt_oss import GptOssExperts
from versions import older_than

from tes_grpo.experts import fused_experts as fe

pytestmark = pytest.mark.usefixtures("one_torch_thread")


def experts_module(dtype, hidden=64, inter=48, experts=8, seed=0) -> GptOssExperts:
    """Experts whose gate/up values often pass swiglu_limit (7), so the clamps' gradients are exercised."""
    config = GptOssConfig(hidden_size=hidden, intermediate_size=inter, num_local_experts=experts,
                          num_experts_per_tok=4)
    config._experts_implementation = "grouped_mm"
    torch.manual_seed(seed)
    module = GptOssExperts(config)
    with torch.no_grad():
        module.gate_up_proj.normal_(0, 1.2)
        module.gate_up_proj_bias.normal_(0, 2.0)
        module.down_proj.normal_(0, 0.2)
        module.down_proj_bias.normal_(0, 0.5)
    return module.to(dtype).requires_grad_(False)


def routed_inputs(module, tokens=37, seed=1, dtype=torch.float32):
    g = torch.Generator().manual_seed(seed)
    hidden = torch.randn(tokens, module.hidden_size, generator=g).to(dtype).requires_grad_()
    logits = torch.randn(tokens, module.num_experts, generator=g)
    top, index = torch.topk(logits, 4, dim=-1)
    weights = torch.softmax(top, dim=-1).to(dtype).requires_grad_()
    return hidden, index, weights


def forward_and_grads(forward, module, hidden, index, weights, grad_out):
    hidden, weights = hidden.detach().requires_grad_(), weights.detach().requires_grad_()
    out = forward(module, hidden, index, weights)
    out.backward(grad_out)
    return out.detach(), hidden.grad, weights.grad


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_forward_is_transformers_bit_for_bit(dtype):
    module = experts_module(dtype)
    hidden, index, weights = routed_inputs(module, dtype=dtype)
    ours = fe.fused_experts_forward(module, hidden, index, weights)
    theirs = grouped_mm_experts_forward(module, hidden, index, weights)
    assert ours.dtype == theirs.dtype == dtype
    assert torch.equal(ours, theirs)


def test_the_test_data_reaches_the_clamps():
    module = experts_module(torch.float32)
    hidden, index, weights = routed_inputs(module)
    gate_up = hidden[:, None, None, :] @ module.gate_up_proj[index] + module.gate_up_proj_bias[index][:, :, None, :]
    gate, up = gate_up[..., ::2], gate_up[..., 1::2]
    assert (gate > module.limit).float().mean() > 0.05
    assert (up.abs() > module.limit).float().mean() > 0.05


@pytest.mark.parametrize("dtype,rtol,atol", [
    (torch.float32, 1e-5, 1e-5),  # same math, float32 throughout: only summation order differs
    (torch.bfloat16, 2e-2, 2e-2),  # autograd rounds to bf16 after each op, the fused backward once
])
def test_gradients_match_autograd_through_transformers(dtype, rtol, atol):
    module = experts_module(dtype)
    hidden, index, weights = routed_inputs(module, dtype=dtype)
    grad_out = torch.randn(hidden.shape, generator=torch.Generator().manual_seed(2)).to(dtype)
    ours = forward_and_grads(fe.fused_experts_forward, module, hidden, index, weights, grad_out)
    theirs = forward_and_grads(grouped_mm_experts_forward, module, hidden, index, weights, grad_out)
    for name, a, b in zip(("output", "d hidden", "d routing weights"), ours, theirs, strict=True):
        scale = b.float().abs().max()
        assert torch.allclose(a.float(), b.float(), rtol=rtol, atol=atol * scale), name


@pytest.mark.parametrize("function,backward,wrt", [
    ("bias_swiglu", "bias_swiglu_backward", (0,)),  # d gate_up
    ("bias_weight_combine", "bias_weight_combine_backward", (0, 3)),  # d down, d routing weights
])
def test_backward_is_the_derivative_in_float64(function, backward, wrt):
    """The hand-written backward against autograd of the forward function, float64 (nothing rounds)."""
    module = experts_module(torch.float64)
    _, index, weights = routed_inputs(module, dtype=torch.float64)
    g = torch.Generator().manual_seed(3)
    expert_ids, perm = torch.sort(index.reshape(-1))
    inv_perm = torch.empty_like(perm)
    inv_perm[perm] = torch.arange(perm.numel())
    if function == "bias_swiglu":
        gate_up = torch.randn(perm.numel(), 2 * module.intermediate_size, dtype=torch.float64, generator=g) * 6
        args = [gate_up, module.gate_up_proj_bias, expert_ids, module.alpha, module.limit]
        extra = list(args)
    else:
        down = torch.randn(perm.numel(), module.hidden_size, dtype=torch.float64, generator=g)
        args = [down, module.down_proj_bias, expert_ids, weights.detach().reshape(-1)[perm], inv_perm, 4]
        extra = [down, module.down_proj_bias, expert_ids, args[3], perm, 4]
    inputs = [args[i].clone().requires_grad_() for i in wrt]
    for i, t in zip(wrt, inputs, strict=True):
        args[i] = t
    out = getattr(fe, function)(*args)
    grad = torch.randn(out.shape, dtype=torch.float64, generator=g)
    expected = torch.autograd.grad(out, inputs, grad)
    got = getattr(fe, backward)(grad, *extra)
    got = got if isinstance(got, tuple) else (got,)
    for a, b in zip(got, expected, strict=True):
        assert torch.allclose(a, b, rtol=1e-12, atol=1e-12)


def test_installed_forward_fuses_only_with_grad_on(monkeypatch):
    model = tiny_model()
    assert fe.use_fused_experts(model, say=pytest.fail) == 2
    calls = []
    monkeypatch.setattr(fe, "fused_experts_forward",
                        lambda *a: calls.append(1) or grouped_mm_experts_forward(*a))
    model.model.embed_tokens.weight.requires_grad_(True)
    ids = torch.randint(0, 100, (2, 9))
    with torch.no_grad():
        model(input_ids=ids)
    assert calls == []  # sampling and scoring keep transformers' experts
    model(input_ids=ids).logits.sum().backward()
    assert calls == [1, 1]  # one call per layer


# (LoRA on the experts of these layers (train_grpo's LORA_EXPERT_LAYERS), trainable tensors)
LORA_CASES = [
    ((), 2 * 4 * 2),  # the default: 2 layers x q/k/v/o x A/B
    ((1,), 2 * 4 * 2 + 2 * 2),  # + layer 1's gate_up_proj and down_proj through PEFT's target_parameters
]


@pytest.mark.parametrize("expert_layers, trainable", LORA_CASES)
def test_tiny_model_loss_and_lora_grads_unchanged(expert_layers, trainable, monkeypatch):
    from peft import get_peft_model

    from train_grpo import build_lora_config

    calls = []
    real = fe.fused_experts_forward
    monkeypatch.setattr(fe, "fused_experts_forward", lambda *a: calls.append(1) or real(*a))
    results = []
    for fused in (False, True):
        torch.manual_seed(0)
        config = build_lora_config(4, 8, expert_layers)
        config.init_lora_weights = False  # B != 0: the adapter changes the outputs
        model = get_peft_model(tiny_model(), config)
        if fused:
            assert fe.use_fused_experts(model, say=pytest.fail) == 2
        ids = torch.randint(0, 100, (3, 11), generator=torch.Generator().manual_seed(4))
        loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.requires_grad}
        results.append((loss.detach(), grads))
    (loss_a, grads_a), (loss_b, grads_b) = results
    assert calls == [1, 1]  # the second model's two layers took the fused path (through PEFT's wrappers too)
    assert torch.equal(loss_a, loss_b)
    assert grads_a.keys() == grads_b.keys() and len(grads_a) == trainable
    for name in grads_a:
        assert torch.allclose(grads_a[name], grads_b[name], rtol=1e-4, atol=1e-7), name


@pytest.mark.parametrize("change,reason", [
    (lambda m: m.gate_up_proj_bias.requires_grad_(True), "gate_up_proj_bias is trainable"),  # biases get no grad
    (lambda m: m.down_proj_bias.requires_grad_(True), "down_proj_bias is trainable"),
    (lambda m: setattr(m, "_is_expert_parallel", True), "expert parallel"),  # sentinel rows
    (lambda m: delattr(m, "is_transposed"), "no is_transposed"),  # not the transformers 5.x layout
])
def test_refusals_say_why_and_keep_transformers(change, reason):
    model = tiny_model()
    change(model.model.layers[0].mlp.experts)
    said = []
    assert fe.use_fused_experts(model, say=said.append) == 1
    assert len(said) == 1 and reason in said[0] and "model.layers.0.mlp.experts" in said[0]
    assert not fe.uses_fused_experts(model.model.layers[0].mlp.experts)
    assert fe.uses_fused_experts(model.model.layers[1].mlp.experts)


def test_a_bias_made_trainable_later_falls_back(monkeypatch):
    model = tiny_model()
    fe.use_fused_experts(model, say=pytest.fail)
    model.model.layers[0].mlp.experts.down_proj_bias.requires_grad_(True)
    model.model.embed_tokens.weight.requires_grad_(True)
    calls = []
    monkeypatch.setattr(fe, "fused_experts_forward", lambda *a: calls.append(1) or grouped_mm_experts_forward(*a))
    model(input_ids=torch.randint(0, 100, (1, 5))).logits.sum().backward()
    assert calls == [1]  # layer 1 only
    assert model.model.layers[0].mlp.experts.down_proj_bias.grad is not None


@pytest.mark.slow
@pytest.mark.parametrize("device", [
    "cuda",  # where train_grpo compiles them (fused_experts._kernel)
    "cpu",  # inductor's CPU backend, the same functions and options (CI has no GPU)
])
def test_compiled_forward_keeps_eager_bf16_roundings(device):
    """What the GPU runs: the functions through torch.compile, against the same functions eagerly."""
    if device == "cuda" and not torch.cuda.is_available():
        pytest.skip("no CUDA device: the CPU case compiles the same functions with inductor's CPU backend")
    if device == "cpu" and older_than("torch", "2.13"):
        pytest.skip("inductor's CPU backend in torch 2.11 rounds bias_swiglu differently from eager (a bf16 step in "
                    "some elements, seen on the GPU machine); train_grpo compiles these only for CUDA: the cuda case")
    module = experts_module(torch.bfloat16, hidden=128, inter=96).to(device)
    hidden, index, weights = routed_inputs(module, tokens=64, dtype=torch.bfloat16)
    index, weights = index.to(device), weights.to(device)
    expert_ids, perm = torch.sort(index.reshape(-1))
    gate_up = torch.randn(perm.numel(), 2 * module.intermediate_size, dtype=torch.bfloat16).to(device) * 6
    args = (gate_up, module.gate_up_proj_bias, expert_ids, module.alpha, module.limit)
    compiled = torch.compile(fe.bias_swiglu, fullgraph=True, options={"emulate_precision_casts": True})
    assert torch.equal(compiled(*args), fe.bias_swiglu(*args))
    down = torch.randn(perm.numel(), module.hidden_size, dtype=torch.bfloat16).to(device)
    inv_perm = torch.empty_like(perm)
    inv_perm[perm] = torch.arange(perm.numel(), device=device)
    args = (down, module.down_proj_bias, expert_ids, weights.detach().reshape(-1)[perm], inv_perm, 4)
    compiled = torch.compile(fe.bias_weight_combine, fullgraph=True, options={"emulate_precision_casts": True})
    assert torch.equal(compiled(*args), fe.bias_weight_combine(*args))
    grad = torch.randn(perm.numel(), module.intermediate_size, dtype=torch.bfloat16).to(device)
    args = (grad, gate_up, module.gate_up_proj_bias, expert_ids, module.alpha, module.limit)
    compiled = torch.compile(fe.bias_swiglu_backward, fullgraph=True, options={"emulate_precision_casts": True})
    got, eager = compiled(*args).float(), fe.bias_swiglu_backward(*args).float()
    # float32 inside either way (sigmoid's implementations differ in the last float32 bits): at most one bf16 step
    assert ((got - eager).abs() <= eager.abs() * 2 ** -7).all()


def tiny_model() -> GptOssForCausalLM:
    config = GptOssConfig(vocab_size=100, hidden_size=32, intermediate_size=24, num_hidden_layers=2,
                          num_attention_heads=4, num_key_value_heads=2, head_dim=8, num_local_experts=8,
                          num_experts_per_tok=4, layer_types=["sliding_attention", "full_attention"],
                          sliding_window=4)
    torch.manual_seed(0)
    model = GptOssForCausalLM._from_config(config, attn_implementation="eager", dtype=torch.float32)
    model.config._experts_implementation = "grouped_mm"
    for experts in (m for m in model.modules() if isinstance(m, GptOssExperts)):
        with torch.no_grad():
            experts.gate_up_proj.normal_(0, 1.0)
            experts.gate_up_proj_bias.normal_(0, 1.0)
    return model.requires_grad_(False)
