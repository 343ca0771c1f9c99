"""tes_grpo/layers/train_glue.py on the CPU: installed on a LoRA gpt-oss, the training glue (run eagerly here, as
TRAIN_GLUE=compiled runs it off CUDA) gives the libraries' loss and gradients bit for bit, and it is really called;
where it would compute something else (no gradients, PEFT's input cast that autocast does not undo, dropout) the
libraries' forward runs; the sink step on the transposed output is transformers' sink step; the library patches it
needs install, swap and restore cleanly. tests/gpu_cuda_test.py compares the compiled functions with these."""

from __future__ import annotations

import contextlib

import pytest
import torch
import transformers.models.gpt_oss.modeling_gpt_oss as modeling_gpt_oss
from peft import LoraConfig, get_peft_model
from transformers import GptOssConfig, GptOssForCausalLM

from tes_grpo.layers import decode_glue, train_glue


def lora_model(dtype: torch.dtype, dropout: float = 0.0):
    """A two-layer gpt-oss (sliding + full attention) in `dtype` with the recipe's LoRA (float32 adapter, as PEFT
    keeps it), its B drawn so the adapter changes the output, gradient checkpointing on, in train mode."""
    config = GptOssConfig(vocab_size=300, hidden_size=64, intermediate_size=64, num_hidden_layers=2,
                          num_attention_heads=4, num_key_value_heads=2, head_dim=16, num_local_experts=4,
                          num_experts_per_tok=2, sliding_window=8, layer_types=["sliding_attention", "full_attention"],
                          attn_implementation="eager")
    torch.manual_seed(0)
    model = get_peft_model(GptOssForCausalLM(config).to(dtype),
                           LoraConfig(r=4, lora_alpha=8, lora_dropout=dropout, target_modules="all-linear"))
    for name, param in model.named_parameters():
        if "lora_B" in name:
            torch.nn.init.normal_(param, std=0.05)
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    model.train()
    return model


class Counting:
    """A TrainGlue's functions, each counting its calls."""

    def __init__(self):
        self.calls = dict.fromkeys(("rms_norm", "add_scaled", "rope", "with_sinks"), 0)

        def counted(name):
            def call(*args):
                self.calls[name] += 1
                return getattr(train_glue, name)(*args)
            return call

        self.glue = train_glue.TrainGlue(*(counted(name) for name in self.calls), how="counted")


@contextlib.contextmanager
def installed(model, glue):
    """The training glue on `model` and the rotary patch for a with-block, both undone after."""
    train_glue.use_train_glue(model, glue)
    train_glue.rope_through(glue)
    try:
        yield model
    finally:
        train_glue.drop_train_glue(model)
        train_glue.rope_through(None)


def loss_and_grads(model, autocast: torch.dtype | None, grad: bool = True):
    ids = torch.randint(0, 300, (2, 21), generator=torch.Generator().manual_seed(1))
    with torch.set_grad_enabled(grad), torch.autocast("cpu", dtype=autocast or torch.bfloat16,
                                                      enabled=autocast is not None):
        logits = model(input_ids=ids, use_cache=False).logits
    if not grad:
        return logits, []
    logits.float().square().mean().backward()
    grads = [p.grad.clone() for p in model.parameters() if p.requires_grad]
    model.zero_grad(set_to_none=True)
    return logits.detach(), grads


# (model dtype, autocast): the GPU's bf16 model under bf16 autocast (where PEFT's input cast is undone), the CPU's
# float32 model (input already in the adapter's dtype), float32 under bf16 autocast
TRAINING_CASES = [(torch.bfloat16, torch.bfloat16), (torch.float32, None), (torch.float32, torch.bfloat16)]


@pytest.mark.parametrize("dtype, autocast", TRAINING_CASES)
def test_the_training_glue_gives_the_libraries_loss_and_gradients_bit_for_bit(dtype, autocast):
    model = lora_model(dtype)
    want_logits, want_grads = loss_and_grads(model, autocast)
    counting = Counting()
    with installed(model, counting.glue):
        got_logits, got_grads = loss_and_grads(model, autocast)
    assert torch.equal(got_logits, want_logits)
    assert len(got_grads) == len(want_grads) == 16 and all(map(torch.equal, got_grads, want_grads))
    # 2 layers x 2 norms + the final one, 8 projections, 2 layers' rotary embedding: each forward and recompute
    assert counting.calls["rms_norm"] >= 5 and counting.calls["add_scaled"] >= 8 and counting.calls["rope"] >= 2


def test_installing_counts_the_modules_and_dropping_gives_the_class_forward_back():
    model = lora_model(torch.float32)
    replaced = model.base_model.model.model.norm
    replaced.forward = lambda hidden: hidden  # a forward replaced on the instance (a hub kernel) is left alone
    assert train_glue.use_train_glue(model, train_glue.EAGER) == (4, 8)
    assert sum(map(train_glue.uses_train_glue, model.modules())) == 12
    other = Counting().glue  # installing again swaps the glue of the modules that have it
    assert train_glue.use_train_glue(model, other) == (4, 8)
    assert all(m._train_glue is other for m in model.modules() if train_glue.uses_train_glue(m))
    assert train_glue.drop_train_glue(model) == 12 and not any(map(train_glue.uses_train_glue, model.modules()))
    assert "forward" not in vars(model.base_model.model.model.layers[0].input_layernorm)


# (what changes, how many adapter adds the glue may make): where the glue would compute something else, PEFT's and
# transformers' forward run
FALLBACK_CASES = [
    ("no_grad", 0),  # sampling and evaluation: the libraries' code, whatever the device
    ("bf16 without autocast", 0),  # PEFT's cast to the float32 adapter then changes what lora_A computes in
    ("dropout", 0),  # LoRA dropout on in training: layers/lora.py's lora_parts refuses it, PEFT's forward runs
]


@pytest.mark.parametrize("case, adds", FALLBACK_CASES)
def test_the_libraries_forward_runs_where_the_glue_would_compute_something_else(case, adds):
    model = lora_model(torch.bfloat16 if case == "bf16 without autocast" else torch.float32,
                       dropout=0.5 if case == "dropout" else 0.0)
    grad, autocast = case != "no_grad", None
    torch.manual_seed(2)
    want = loss_and_grads(model, autocast, grad)
    counting = Counting()
    with installed(model, counting.glue):
        torch.manual_seed(2)  # dropout draws the same masks
        got = loss_and_grads(model, autocast, grad)
    if case == "no_grad":  # sampling and evaluation keep the libraries' code: no glue function runs
        assert counting.calls == dict.fromkeys(counting.calls, 0)
    assert counting.calls["add_scaled"] == adds
    assert torch.equal(got[0], want[0]) and all(map(torch.equal, got[1], want[1]))


@pytest.mark.parametrize("autocast", [None, torch.bfloat16])
def test_the_sink_step_on_the_transposed_output_is_transformers_sink_step(autocast):
    """train_glue.with_sinks takes flex attention's output as transformers returns it ([B, L, H, D]); it must equal the
    sink step transformers applies before the transpose (decode_glue.with_sinks mirrors that step, op for op)."""
    g = torch.Generator().manual_seed(4)
    out = torch.randn(2, 4, 7, 16, generator=g).to(torch.bfloat16)  # [B, H, L, D], as flex attention gives it
    lse = (10 + 3 * torch.randn(2, 4, 7, generator=g)).to(torch.bfloat16)
    sinks = torch.randn(4, generator=g).to(torch.bfloat16)
    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast is not None):
        want = decode_glue.with_sinks(out, lse, sinks).transpose(1, 2)
        got = train_glue.with_sinks(out.transpose(1, 2).contiguous(), lse, sinks)
    assert got.dtype == want.dtype and torch.equal(got, want)


def test_the_sink_wrapper_calls_the_attention_as_it_is_off_the_cuda_training_forward():
    calls = []

    def attention(module, query, key, value, mask, *args, s_aux=None, **kwargs):
        calls.append((s_aux, kwargs))
        return query, None

    wrapped = train_glue.SinksInTraining(attention, train_glue.EAGER)
    query, sinks = torch.randn(1, 2, 3, 4), torch.randn(2)
    assert wrapped(None, query, query, query, None, s_aux=sinks, scaling=0.5)[0] is query  # a CPU tensor
    assert calls == [(sinks, {"scaling": 0.5})]


def test_the_library_patches_install_swap_and_restore():
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

    rope, flex = modeling_gpt_oss.apply_rotary_pos_emb, ALL_ATTENTION_FUNCTIONS["flex_attention"]
    first, second = Counting().glue, Counting().glue
    try:
        for glue in (first, second):  # installing again swaps the glue, never wraps a wrapper
            assert train_glue.rope_through(glue) and train_glue.sinks_through(glue)
            assert modeling_gpt_oss.apply_rotary_pos_emb.wraps_original is rope
            assert ALL_ATTENTION_FUNCTIONS["flex_attention"].wraps_original is flex
            assert ALL_ATTENTION_FUNCTIONS["flex_attention"].glue is glue
    finally:
        train_glue.rope_through(None)
        train_glue.sinks_through(None)
    assert modeling_gpt_oss.apply_rotary_pos_emb is rope and ALL_ATTENTION_FUNCTIONS["flex_attention"] is flex


def test_decode_glue_still_computes_a_norm_that_carries_the_training_forward():
    model = lora_model(torch.float32)
    norm = model.base_model.model.model.norm
    train_glue.use_train_glue(model, train_glue.EAGER)
    assert train_glue.uses_train_glue(norm) and decode_glue.norm_weights(norm) == (norm.weight, norm.variance_epsilon)


def test_decide_says_how_the_functions_run():
    assert train_glue.decide("cpu", "eager") is train_glue.EAGER
    assert train_glue.decide("cpu", "compiled").how.startswith("eager (TRAIN_GLUE=compiled compiles only on CUDA")
    with pytest.raises(ValueError, match="TRAIN_GLUE"):
        train_glue.decide("cuda", "fused")


# (input dtype, adapter dtype, autocast dtype or None, does PEFT's cast change nothing lora_A computes?)
CAST_CASES = [
    (torch.bfloat16, torch.float32, torch.bfloat16, True),  # the GPU's training: autocast casts the float32 back
    (torch.float32, torch.float32, None, True),  # no cast at all
    (torch.bfloat16, torch.float32, None, False),  # without autocast lora_A would compute in float32
    (torch.float32, torch.bfloat16, torch.bfloat16, True),  # autocast's own dtype
    (torch.float32, torch.bfloat16, torch.float16, False),  # float32 -> bf16 -> fp16 rounds twice
    (torch.bfloat16, torch.float16, torch.bfloat16, False),  # bf16 -> fp16 may round, then back to bf16
]


@pytest.mark.parametrize("x_dtype, adapter_dtype, autocast, unchanged", CAST_CASES)
def test_the_input_cast_is_skipped_only_where_it_changes_nothing(x_dtype, adapter_dtype, autocast, unchanged):
    x = (torch.randn(64, 16, generator=torch.Generator().manual_seed(5)) * 3).to(x_dtype)
    weight = torch.randn(4, 16, generator=torch.Generator().manual_seed(6)).to(adapter_dtype)
    with torch.autocast("cpu", dtype=autocast or torch.bfloat16, enabled=autocast is not None):
        assert train_glue.cast_changes_nothing(x, adapter_dtype) is unchanged
        if unchanged:
            peft_way = torch.nn.functional.linear(x.to(adapter_dtype), weight)
            assert torch.equal(torch.nn.functional.linear(x, weight), peft_way)
