"""gpt-oss-20b's architecture without its weights, for GPU benchmarks on machines with no model hub.

`build_random_model()` makes a `GptOssForCausalLM` with openai/gpt-oss-20b's exact shapes (20.9 B
parameters, 39 GiB in bf16) and random weights directly on the GPU: same cost and memory as the real
model, though random weights never emit an end token, so every completion runs to its maximum length.
The expert weights are random MXFP4 values, as the real checkpoint's are once loaded dequantized.
"""

from __future__ import annotations

import contextlib
import platform

import torch

# openai/gpt-oss-20b's config.json, less the quantization block (these weights are bf16 from the start).
GPT_OSS_20B = dict(
    vocab_size=201088, hidden_size=2880, intermediate_size=2880, num_hidden_layers=24, num_attention_heads=64,
    num_key_value_heads=8, head_dim=64, num_local_experts=32, num_experts_per_tok=4, sliding_window=128,
    layer_types=["sliding_attention", "full_attention"] * 12, rope_theta=150000.0, max_position_embeddings=131072,
    rope_scaling=dict(rope_type="yarn", factor=32.0, beta_fast=32.0, beta_slow=1.0, truncate=False,
                      original_max_position_embeddings=4096),
    initial_context_length=4096, swiglu_limit=7.0, rms_norm_eps=1e-5, attention_bias=True, tie_word_embeddings=False,
    pad_token_id=199999, eos_token_id=200002, bos_token_id=199998, use_cache=True,
)


def gpt_oss_20b_config(**overrides):
    from transformers import GptOssConfig

    return GptOssConfig(**{**GPT_OSS_20B, **overrides})


def random_mxfp4_experts(model, seed: int = 0) -> None:
    """Sets every expert weight to random MXFP4 values (uniform FP4 codes, scales 2**-8..2**-6: std ~0.02), as the
    real checkpoint's are when loaded dequantized to bf16; graph_decode's MXFP4 decoding packs only such weights."""
    from tes_grpo.mxfp4 import BLOCK_SIZE, E8M0_BIAS, mxfp4_to_expert_param

    generator = torch.Generator(device=next(model.parameters()).device).manual_seed(seed)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name.endswith(("experts.gate_up_proj", "experts.down_proj")):
                experts, inputs, outputs = param.shape
                for e in range(experts):
                    shape = (1, outputs, inputs // BLOCK_SIZE)
                    blocks = torch.randint(0, 256, (*shape, BLOCK_SIZE // 2), dtype=torch.uint8, device=param.device,
                                           generator=generator)
                    scales = torch.randint(E8M0_BIAS - 8, E8M0_BIAS - 5, shape, dtype=torch.uint8,
                                           device=param.device, generator=generator)
                    param[e].copy_(mxfp4_to_expert_param(blocks, scales, param.dtype)[0])


def build_random_model(attn_implementation: str = "flex_attention", device: str = "cuda", mxfp4_experts: bool = True,
                       **overrides):
    """The 20B architecture in bf16 on `device` with small random weights (std 0.02, like its init); the experts'
    are random MXFP4 values (random_mxfp4_experts) unless mxfp4_experts=False."""
    from transformers import GptOssForCausalLM

    config = gpt_oss_20b_config(**overrides)
    config._attn_implementation = attn_implementation
    with torch.device(device):
        previous = torch.get_default_dtype()
        torch.set_default_dtype(torch.bfloat16)
        try:
            model = GptOssForCausalLM(config)
        finally:
            torch.set_default_dtype(previous)
    if mxfp4_experts:
        random_mxfp4_experts(model)
    model.eval()
    n = sum(p.numel() for p in model.parameters())
    print(f"random gpt-oss-20b-shaped model: {n / 1e9:.2f} B parameters, "
          f"{sum(p.numel() * p.element_size() for p in model.parameters()) / 2**30:.1f} GiB, "
          f"attention {attn_implementation}, experts {'random MXFP4 values' if mxfp4_experts else 'random bf16'}")
    return model


def stack_versions() -> str:
    import transformers

    parts = [f"python {platform.python_version()}", f"torch {torch.__version__}",
             f"transformers {transformers.__version__}"]
    for name in ("trl", "peft", "accelerate", "triton"):
        with contextlib.suppress(ImportError):
            parts.append(f"{name} {__import__(name).__version__}")
    if torch.cuda.is_available():
        parts.append(f"device {torch.cuda.get_device_name()}")
    return ", ".join(parts)
