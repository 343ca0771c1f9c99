"""gpt-oss-20b's and gpt-oss-120b's architectures without their weights, for GPU benchmarks on machines with no
model hub.

`build_random_model()` makes a `GptOssForCausalLM` with openai/gpt-oss-20b's exact shapes (20.9 B
parameters, 39 GiB in bf16) and random weights directly on the GPU: same cost and memory as the real
model, though random weights never emit an end token, so every completion runs to its maximum length.
The expert weights are random MXFP4 values, as the real checkpoint's are once loaded dequantized.
`size="120b"` gives gpt-oss-120b's shapes; `resident=True` keeps the experts as random MXFP4 blocks and scales
(mxfp4_experts.py) and never builds them in bf16 (the 120B's experts would take 216 GiB in bf16, ~57 GiB as
MXFP4).
"""

from __future__ import annotations

import contextlib
import math
import platform

import torch
import transformers
from transformers import GptOssConfig, GptOssForCausalLM

from tes_grpo.experts.mxfp4 import BLOCK_SIZE, E8M0_BIAS, mxfp4_to_expert_param
from tes_grpo.experts.mxfp4_experts import expected_shapes, is_resident, make_resident, resident_bytes
from tes_grpo.task.harmony import BOS_ID, PAD_ID, RETURN_ID

# openai/gpt-oss-20b's config.json, less the quantization block (these weights are bf16 from the start); its
# special token ids are harmony's (eos: <|return|>).
GPT_OSS_20B = dict(
    vocab_size=201088, hidden_size=2880, intermediate_size=2880, num_hidden_layers=24, num_attention_heads=64,
    num_key_value_heads=8, head_dim=64, num_local_experts=32, num_experts_per_tok=4, sliding_window=128,
    layer_types=["sliding_attention", "full_attention"] * 12, rope_theta=150000.0, max_position_embeddings=131072,
    rope_scaling=dict(rope_type="yarn", factor=32.0, beta_fast=32.0, beta_slow=1.0, truncate=False,
                      original_max_position_embeddings=4096),
    initial_context_length=4096, swiglu_limit=7.0, rms_norm_eps=1e-5, attention_bias=True, tie_word_embeddings=False,
    pad_token_id=PAD_ID, eos_token_id=RETURN_ID, bos_token_id=BOS_ID, use_cache=True,
)


# openai/gpt-oss-120b's config.json (original/config.json on its hub page: 36 layers, 128 experts, 4 per token,
# hidden and intermediate 2880, 64 heads of 64, 8 kv heads, window 128, vocab 201088, the same RoPE: theta 150000,
# yarn factor 32, beta 32/1, 4096 original positions): the 20B's but for depth and experts.
GPT_OSS_120B = dict(GPT_OSS_20B, num_hidden_layers=36, num_local_experts=128,
                    layer_types=["sliding_attention", "full_attention"] * 18)
SIZES = {"20b": GPT_OSS_20B, "120b": GPT_OSS_120B}


def gpt_oss_config(size: str = "20b", **overrides):
    """GptOssConfig of openai/gpt-oss-{size} ("20b" or "120b") with overrides (e.g. fewer layers for a test)."""
    if size not in SIZES:
        raise ValueError(f"size must be one of {', '.join(SIZES)}, got {size!r}")
    shape = dict(SIZES[size])
    if "num_hidden_layers" in overrides and "layer_types" not in overrides:  # gpt-oss alternates the two kinds
        overrides["layer_types"] = [("sliding_attention", "full_attention")[i % 2]
                                    for i in range(overrides["num_hidden_layers"])]
    return GptOssConfig(**{**shape, **overrides})


def gpt_oss_20b_config(**overrides):
    return gpt_oss_config("20b", **overrides)


def gpt_oss_120b_config(**overrides):
    return gpt_oss_config("120b", **overrides)


def random_mxfp4_experts(model, seed: int = 0) -> None:
    """Sets every expert weight to random MXFP4 values (uniform FP4 codes, scales 2**-8..2**-6: std ~0.02), as the
    real checkpoint's are when loaded dequantized to bf16; graph_decode's MXFP4 decoding packs only such weights."""
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


def random_resident_blocks(experts, generator: torch.Generator, device) -> dict[str, torch.Tensor]:
    """Random `{proj}_{blocks|scales}` for one experts module: uniform FP4 codes, scales 2**-8..2**-6 (as
    random_mxfp4_experts draws them)."""
    tensors = {}
    for name, shape in expected_shapes(experts).items():
        low, high = (0, 256) if name.endswith("_blocks") else (E8M0_BIAS - 8, E8M0_BIAS - 5)
        tensors[name] = torch.randint(low, high, shape, dtype=torch.uint8, device=device, generator=generator)
    return tensors


def _build_resident(config, device, dtype, seed: int):
    """The model built on the meta device, its experts made resident with random blocks on `device`, then every
    other weight materialized there and initialized as GptOssForCausalLM's own init does (transformers 5.17-5.24's
    private _init_weights, module by module): no bf16 expert tensor."""
    previous = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        with torch.device("meta"):
            model = GptOssForCausalLM(config)
    finally:
        torch.set_default_dtype(previous)
    generator = torch.Generator(device=device).manual_seed(seed)
    for layer in model.model.layers:
        experts = layer.mlp.experts
        make_resident(experts, random_resident_blocks(experts, generator, device), dtype)
    with torch.no_grad():
        for module in model.modules():
            for name, param in list(module._parameters.items()):
                if param is not None and param.is_meta:
                    module._parameters[name] = torch.nn.Parameter(torch.empty_like(param, device=device),
                                                                  requires_grad=param.requires_grad)
            for name, buffer in list(module._buffers.items()):
                if buffer is not None and buffer.is_meta:
                    module._buffers[name] = torch.empty_like(buffer, device=device)
            if is_resident(module):  # its init would write random bf16 weights; its biases start at 0, as there
                module.gate_up_proj_bias.zero_()
                module.down_proj_bias.zero_()
            else:
                model._init_weights(module)
    return model


def build_random_model(attn_implementation: str = "flex_attention", device: str = "cuda", mxfp4_experts: bool = True,
                       size: str = "20b", resident: bool = False, dtype=torch.bfloat16, seed: int = 0, **overrides):
    """gpt-oss-{size}'s architecture in `dtype` (bf16) on `device` with small random weights (std 0.02, like its
    init); the experts' are random MXFP4 values (random_mxfp4_experts) unless mxfp4_experts=False. resident=True:
    the experts are resident MXFP4 (mxfp4_experts.py) with random blocks and scales, never built in bf16."""
    config = gpt_oss_config(size, **overrides)
    config._attn_implementation = attn_implementation
    if resident:
        if not mxfp4_experts:
            raise ValueError("resident experts are MXFP4 values by construction (mxfp4_experts=False contradicts)")
        model = _build_resident(config, device, dtype, seed)
    else:
        with torch.device(device):
            previous = torch.get_default_dtype()
            torch.set_default_dtype(dtype)
            try:
                model = GptOssForCausalLM(config)
            finally:
                torch.set_default_dtype(previous)
        if mxfp4_experts:
            random_mxfp4_experts(model, seed)
    model.eval()
    # a resident expert weight is two FP4 values a blocks byte in the checkpoint's shape (its scales are not weights)
    params = dict(model.named_parameters())
    n = sum(p.numel() for p in params.values()) + sum(
        math.prod(shape) * 2 for module in model.modules() if is_resident(module)
        for name, shape in expected_shapes(module).items() if name.endswith("_blocks"))
    experts = ("resident MXFP4 (random blocks and scales)" if resident
               else "random MXFP4 values" if mxfp4_experts else "random bf16")
    print(f"random gpt-oss-{size}-shaped model: {n / 1e9:.2f} B parameters, "
          f"{(sum(p.nbytes for p in params.values()) + resident_bytes(model)) / 2**30:.1f} GiB, "
          f"attention {attn_implementation}, experts {experts}")
    return model


def stack_versions(device: bool = True) -> str:
    """Python's, torch's (and the CUDA it was built with) and the libraries' versions; with `device`, the GPU's name
    where torch sees one."""
    parts = [f"python {platform.python_version()}", f"torch {torch.__version__}",
             f"CUDA {torch.version.cuda or 'none (a CPU build of torch)'}",
             f"transformers {transformers.__version__}"]
    for name in ("trl", "peft", "accelerate", "triton"):
        with contextlib.suppress(ImportError):
            parts.append(f"{name} {__import__(name).__version__}")
    if device and torch.cuda.is_available():
        parts.append(f"device {torch.cuda.get_device_name()}")
    return ", ".join(parts)
