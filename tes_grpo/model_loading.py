"""Where and how a gpt-oss checkpoint is loaded: device, dtype, attention, MXFP4 or not, tokenizer (one home).

train_grpo.py, llm_policy.py (test_lora_adapter.py, evaluate_policy.py) and export_quantized_model.py all decide
these the same way here:
- device "auto": the GPU when torch sees one, else the CPU;
- dtype "auto": bfloat16 on a GPU, float32 on the CPU (bf16 matrix products are slow on most CPUs, and the tiny
  model is small);
- attention "auto": flex_attention on CUDA (it supports gpt-oss's attention sinks; sdpa and flash-attention 2 do
  not), eager on the CPU.
"""

from __future__ import annotations

from pathlib import Path

DEVICES = ("auto", "cpu", "cuda")
DTYPES = ("auto", "bfloat16", "float32", "float16")


def cuda_available() -> bool:
    import torch

    return torch.cuda.is_available()


def resolve_device(device: str = "auto") -> str:
    """"cuda" or "cpu" for DEVICE; raises ValueError for an unknown name or cuda without a GPU."""
    if device not in DEVICES:
        raise ValueError(f"DEVICE must be one of {', '.join(DEVICES)}, got {device!r}")
    if device == "auto":
        return "cuda" if cuda_available() else "cpu"
    if device == "cuda" and not cuda_available():
        raise ValueError("DEVICE=cuda but torch sees no GPU")
    return device


def resolve_attention(requested: str, device: str) -> str:
    """ATTN_IMPLEMENTATION "auto": flex_attention on CUDA, eager on the CPU; any other name is passed through."""
    if requested != "auto":
        return requested
    return "flex_attention" if device == "cuda" else "eager"


def resolve_dtype(dtype: str, device: str):
    """DTYPE "auto": torch.bfloat16 on CUDA, torch.float32 on the CPU; or the named dtype."""
    import torch

    if dtype not in DTYPES:
        raise ValueError(f"DTYPE must be one of {', '.join(DTYPES)}, got {dtype!r}")
    if dtype == "auto":
        return torch.bfloat16 if device == "cuda" else torch.float32
    return getattr(torch, dtype)


def dtype_name(torch_dtype) -> str:
    return str(torch_dtype).removeprefix("torch.")


def checkpoint_is_mxfp4(model_id) -> bool:
    """Whether a checkpoint's config declares MXFP4 (openai/gpt-oss-* and the tiny model do); read before loading,
    because transformers drops the quantization config when it dequantizes."""
    from transformers import AutoConfig

    quantization = getattr(AutoConfig.from_pretrained(model_id), "quantization_config", None) or {}
    method = (quantization.get("quant_method") if isinstance(quantization, dict)
              else getattr(quantization, "quant_method", None))
    return str(getattr(method, "value", method)) == "mxfp4"


def native_mxfp4_blockers(device: str) -> list[str]:
    """Why transformers' native MXFP4 path (experts kept quantized) cannot run here; empty when it can."""
    from transformers.utils import is_kernels_available, is_triton_available

    reasons = []
    if device != "cuda":
        reasons.append("no GPU (on the CPU transformers runs MXFP4 only through hub kernels, use_kernels=True)")
    if not is_triton_available():
        reasons.append("triton is not installed")
    if not is_kernels_available():
        reasons.append("the `kernels` package (a version this transformers accepts) is not installed")
    return reasons


def load_tokenizer_for(model_path, say=print):
    """The checkpoint's own tokenizer, or gpt_oss_tokenizer's (same vocabulary) when its local folder has none."""
    from transformers import AutoTokenizer

    folder = Path(model_path)
    if folder.is_dir() and not (folder / "tokenizer.json").is_file():
        from tes_grpo.gpt_oss_tokenizer import load_tokenizer, tokenizer_source

        say(f"tokenizer: {tokenizer_source()} (no tokenizer.json in {folder})")
        return load_tokenizer()
    return AutoTokenizer.from_pretrained(str(model_path))
