"""decode_glue.py: each glue function, run eagerly, computes bit for bit what the code it stands for computes (the
transformers modules and functions, PEFT's LoRA add), and glue_for decides once how the glue runs and says so. The
compiled functions are checked against these eager ones on CUDA (tests/gpu_cuda_test.py)."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
from peft import LoraConfig, get_peft_model
from transformers import GptOssConfig
from transformers.models.gpt_oss.modeling_gpt_oss import (
    GptOssRMSNorm,
    GptOssRotaryEmbedding,
    apply_rotary_pos_emb,
)

from tes_grpo.layers import decode_glue

DTYPES = [torch.float32, torch.bfloat16]
AUTOCAST = [None, torch.bfloat16]  # as the decode step runs: without autocast, or under the trainer's bf16


def autocast(dtype):
    return torch.autocast("cpu", dtype=dtype, enabled=dtype is not None)


def rms_module(hidden_size: int, dtype, eps: float, seed: int) -> GptOssRMSNorm:
    norm = GptOssRMSNorm(hidden_size, eps=eps)
    with torch.no_grad():  # a trained norm's weight, not ones
        norm.weight.copy_(1 + 0.3 * torch.randn(hidden_size, generator=torch.Generator().manual_seed(seed)))
    return norm.to(dtype)


# (rows, hidden size, eps, scale of the hidden states): the 20B's width and eps; a small width; large and small
# values, where float32's sum of squares and the rounding to bf16 matter
NORM_CASES = [(4, 2880, 1e-5, 1.0), (3, 64, 1e-6, 30.0), (5, 96, 1e-5, 1e-3)]


@pytest.mark.parametrize("rows, size, eps, scale", NORM_CASES)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("cast", AUTOCAST)
def test_residual_norm_is_the_residual_add_then_gpt_oss_rms_norm(rows, size, eps, scale, dtype, cast):
    g = torch.Generator().manual_seed(size)
    norm = rms_module(size, dtype, eps, seed=rows)
    residual = (scale * torch.randn(rows, 1, size, generator=g)).to(dtype)
    delta = (scale * torch.randn(rows, 1, size, generator=g)).to(dtype)
    with torch.no_grad(), autocast(cast):
        expected_hidden = residual + delta
        expected = norm(expected_hidden)
        hidden, normed = decode_glue.residual_norm(residual, delta, norm.weight, norm.variance_epsilon)
        alone = decode_glue.rms_norm(residual, norm.weight, norm.variance_epsilon)
        via_glue = decode_glue.EAGER.add_norm(residual, delta, norm)
        assert torch.equal(alone, norm(residual))
    assert hidden.dtype == normed.dtype == dtype
    assert torch.equal(hidden, expected_hidden) and torch.equal(normed, expected)
    assert torch.equal(via_glue[0], expected_hidden) and torch.equal(via_glue[1], expected)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("position", [0, 7, 1315, 4000])  # the first token, a decode step, a long prompt's end, YaRN
def test_rope_qk_is_transformers_rotary_embedding(dtype, position):
    config = GptOssConfig(hidden_size=64, num_attention_heads=4, num_key_value_heads=2, head_dim=16)
    rotary = GptOssRotaryEmbedding(config)
    g = torch.Generator().manual_seed(position)
    query = torch.randn(3, 1, 4, 16, generator=g).to(dtype).transpose(1, 2)  # laid out as the decode step's
    key = torch.randn(3, 2, 1, 16, generator=g).to(dtype)
    cos, sin = rotary(query, torch.tensor([[position]]))
    ours = decode_glue.rope_qk(query, key, cos, sin)
    theirs = apply_rotary_pos_emb(query, key, cos, sin)
    assert all(a.dtype == dtype and torch.equal(a, b) for a, b in zip(ours, theirs, strict=True))


def transformers_sink_step(out, lse, sinks):
    """The sink step of transformers 5.17-5.24's flex_attention_forward (integrations/flex_attention.py; the lines
    test_graph_decode.py checks are in that source), as it reads there."""
    lse_expanded = lse.to(out.dtype).unsqueeze(-1)
    batch, heads, queries, _ = out.shape
    sinks = sinks.view(1, -1, 1, 1).expand(batch, heads, queries, 1)
    combined_lse = torch.logsumexp(torch.cat([lse_expanded, sinks], dim=-1), dim=-1, keepdim=True)
    renorm_factor = torch.exp(lse_expanded - combined_lse)
    return (out * renorm_factor).to(out.dtype)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("cast", AUTOCAST)
@pytest.mark.parametrize("lse_mean", [0.5, 12.0])  # bf16's log-sum-exp steps: 1/128 near 1, 1/16 at 8 to 16
def test_with_sinks_is_transformers_flex_sink_step(dtype, cast, lse_mean):
    g = torch.Generator().manual_seed(int(lse_mean))
    out = torch.randn(4, 8, 1, 16, generator=g).to(dtype)
    lse = lse_mean + torch.randn(4, 8, 1, generator=g)  # flex attention's float32 log-sum-exp
    sinks = torch.randn(8, generator=g).to(dtype)
    with autocast(cast):
        ours = decode_glue.with_sinks(out, lse, sinks)
        theirs = transformers_sink_step(out, lse, sinks)
    assert ours.dtype == dtype and torch.equal(ours, theirs)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("cast", AUTOCAST)
@pytest.mark.parametrize("scaling", [2.0, 0.37])  # train_grpo's alpha = 2r; a scaling that is no power of two
def test_add_lora_is_pefts_add(dtype, cast, scaling):
    # PEFT's own layer is the reference: its forward adds the adapter's output to the base product and casts
    g = torch.Generator().manual_seed(3)
    model = torch.nn.Sequential(torch.nn.Linear(48, 40)).to(dtype)
    layer = get_peft_model(model, LoraConfig(r=4, lora_alpha=4 * scaling, target_modules=["0"])).base_model.model[0]
    base = layer.base_layer
    with torch.no_grad():
        layer.lora_B["default"].weight.normal_(0.0, 0.2, generator=g)
    assert layer.scaling["default"] == scaling
    x = torch.randn(5, 1, 48, generator=g).to(dtype)
    A, B = layer.lora_A["default"], layer.lora_B["default"]
    with torch.no_grad(), autocast(cast):
        expected = layer(x)
        base_out = torch.nn.functional.linear(x, base.weight, base.bias)
        extra = B(A(x.to(A.weight.dtype))) * scaling
        (ours,) = decode_glue.add_lora([base_out], [extra])
    assert ours.dtype == expected.dtype and torch.equal(ours, expected)


def test_norm_weights_takes_only_gpt_oss_rms_norm_as_its_class_computes_it():
    norm = GptOssRMSNorm(8, eps=1e-5)
    assert decode_glue.norm_weights(norm) == (norm.weight, 1e-5)
    assert decode_glue.norm_weights(torch.nn.RMSNorm(8)) is None  # another class: the module is called
    replaced = GptOssRMSNorm(8)
    replaced.forward = lambda hidden: hidden * 2  # a forward replaced on the instance, as a hub kernel would
    assert decode_glue.norm_weights(replaced) is None
    hidden = torch.randn(2, 1, 8)
    assert torch.equal(decode_glue.EAGER.norm(hidden, replaced), hidden * 2)
    total, normed = decode_glue.EAGER.add_norm(hidden, hidden, replaced)
    assert torch.equal(total, hidden + hidden) and torch.equal(normed, (hidden + hidden) * 2)


def test_glue_for_decides_once_per_device_type_and_mode_and_says_so(monkeypatch):
    monkeypatch.setattr(decode_glue, "_DECIDED", {})
    said = []
    cpu = decode_glue.glue_for(torch.device("cpu"), "compiled", say=said.append)
    assert decode_glue.glue_for(torch.device("cpu"), "compiled", say=said.append) is cpu  # decided once
    assert cpu.rms_norm is decode_glue.rms_norm
    assert "eager (DECODE_GLUE=compiled compiles only on CUDA; this is cpu)" in cpu.how
    assert decode_glue.glue_for("cpu", say=said.append).how == "eager"  # the default mode
    assert len(said) == 2 and said[0].startswith("decode glue (") and said[0].endswith(cpu.how), said
    with pytest.raises(ValueError, match="DECODE_GLUE must be one of eager, compiled, got 'fast'"):
        decode_glue.glue_for("cpu", "fast")


def test_cuda_glue_is_compiled_unless_inductor_cannot_keep_the_roundings(monkeypatch):
    # decided without running anything: torch.compile wraps the functions; they compile when first called
    assert decode_glue.compile_blocker() is None  # this torch has emulate_precision_casts (2.11 has it too)
    glue = decode_glue.decide_glue("cuda", "compiled")
    assert glue.how.startswith("compiled") and "emulate_precision_casts" in glue.how
    assert all(getattr(glue, name) is not getattr(decode_glue.EAGER, name)
               for name in ("rms_norm", "residual_norm", "rope_qk", "with_sinks", "add_lora"))
    assert decode_glue.decide_glue("cuda", "eager") is decode_glue.EAGER
    monkeypatch.setattr(decode_glue, "compile_blocker", lambda: "no emulate_precision_casts")
    fallback = decode_glue.decide_glue("cuda", "compiled")  # eager on the GPU too, and the line says why
    assert fallback.rms_norm is decode_glue.rms_norm and fallback.how == "eager on CUDA: no emulate_precision_casts"


def test_bench_generate_times_the_glue_eager_with_the_eagerglue_flag(monkeypatch):
    # one run times both: graphs_mxfp4 (the glue compiled on CUDA, train_grpo's default) and graphs_mxfp4_eagerglue
    import benchmarks.bench_generate as bench
    from tes_grpo.sampling import graph_decode

    calls = []
    monkeypatch.setattr(graph_decode, "generate", lambda *args, **kwargs: calls.append(kwargs))
    model = SimpleNamespace(config=SimpleNamespace(vocab_size=512, pad_token_id=5))
    for variant in ("graphs_mxfp4", "graphs_mxfp4_eagerglue", "static_eagerglue_unshared", "graphs_mxfp4_flexattn"):
        bench.run_generate(model, None, None, 4, variant, 16)
    assert [c["glue"] for c in calls] == ["compiled", "eager", "eager", "compiled"]
    assert [c["experts"] for c in calls] == ["mxfp4", "mxfp4", "model", "mxfp4"]
    assert [c["attention_kernel"] for c in calls] == ["triton", "triton", "triton", "flex"]
    assert calls[2]["share_prompts"] is False
    assert bench.variant_flags("graphs_eagerglue_eagerglue") is None  # a flag twice is refused, as before
    assert bench.variant_flags("graphs_mxfp4_tiled") is None  # the tiled copy is gone: the experts are kept tiled


@pytest.mark.parametrize("cast, expected", [
    (None, "eager"),  # bf16 inputs reach logsumexp: eager's rounds every step to bf16, inductor's does not
    (torch.bfloat16, "compiled"),  # autocast runs logsumexp in float32, as the trainer's forward does
])
def test_the_compiled_sink_step_runs_only_under_autocast(cast, expected):
    calls = []
    sinks = decode_glue.SinksUnderAutocast(compiled=lambda *args: calls.append("compiled"),
                                           eager=lambda *args: calls.append("eager"))
    out = torch.zeros(1, 2, 1, 4, dtype=torch.bfloat16)
    with autocast(cast):
        sinks(out, torch.zeros(1, 2, 1), torch.zeros(2))
    assert calls == [expected]
