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


# ---------------------------------------------------------------------------------------------------------------
# The policy for training (train_grpo.py): dequantized MXFP4, one process per GPU or FSDP
# ---------------------------------------------------------------------------------------------------------------

TINY_MODEL_ID = "tiny"


def resolve_model_path(model_id: str) -> str:
    """MODEL_ID as from_pretrained takes it; "tiny" builds the tiny checkpoint (once, rank 0 first) -> its folder."""
    if model_id != TINY_MODEL_ID:
        return model_id
    from tes_grpo.processes import is_main_process, wait_for_everyone
    from tes_grpo.tiny_model import ensure_tiny_checkpoint

    if is_main_process():
        path = ensure_tiny_checkpoint()
        wait_for_everyone()
    else:
        wait_for_everyone()  # rank 0 builds it; the others then find it cached
        path = ensure_tiny_checkpoint()
    return str(path)


def model_device_map(cuda: bool, fsdp: bool, processes: int, local_rank: int):
    """Where from_pretrained puts the weights: this process's GPU; the CPU for FSDP (accelerate shards them onto
    the GPUs; with fsdp_cpu_ram_efficient_loading only rank 0 holds real weights) and without a GPU."""
    if not cuda or fsdp:
        return None
    return {"": local_rank} if processes > 1 else "cuda"


def loads_weights_here(cuda: bool, fsdp: bool, processes: int, rank: int) -> bool:
    """False on the ranks > 0 of an FSDP run on GPUs: FSDP broadcasts rank 0's weights to them while sharding
    (fsdp_cpu_ram_efficient_loading), so they need the model's structure only, not a CPU copy of its weights
    (transformers 5.x would otherwise load the whole checkpoint in every process: 8 x 218 GiB for gpt-oss-120b)."""
    return not (cuda and fsdp and processes > 1 and rank != 0)


def empty_policy_model(path: str, dtype, attn: str):
    """The dequantized model's structure with its parameters on the meta device (buffers such as the rotary
    frequencies are real: FSDP does not broadcast non-persistent buffers)."""
    from accelerate import init_empty_weights
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.from_pretrained(path)
    if getattr(config, "quantization_config", None) is not None:
        del config.quantization_config  # as after Mxfp4Config(dequantize=True): plain bf16 experts
    with init_empty_weights(include_buffers=False):
        model = AutoModelForCausalLM.from_config(config, dtype=dtype, attn_implementation=attn)
    model.config.use_cache = True
    return model


def load_training_model(path: str, attn_implementation: str = "auto", dtype=None, say=print):
    """An MXFP4 gpt-oss checkpoint loaded dequantized (`Mxfp4Config(dequantize=True)`) for LoRA training.

    dtype and attention follow resolve_dtype/resolve_attention ("auto"). On the GPU when there is one; under FSDP
    on the CPU on rank 0 and without weights on the other ranks (loads_weights_here).
    """
    from transformers import AutoModelForCausalLM, Mxfp4Config

    from tes_grpo.processes import local_rank, process_count, process_rank, uses_fsdp

    device = resolve_device("auto")
    cuda = device == "cuda"
    attn = resolve_attention(attn_implementation, device)
    dtype = dtype or resolve_dtype("auto", device)
    fsdp, processes = uses_fsdp(), process_count()
    if not loads_weights_here(cuda, fsdp, processes, process_rank()):
        return empty_policy_model(path, dtype, attn)
    device_map = model_device_map(cuda, fsdp, processes, local_rank())
    where = "cpu" if device_map is None else f"cuda:{local_rank()}"
    if cuda and device_map is None:
        where += ", then sharded onto the GPUs by FSDP"
    say(f"loading {path} with Mxfp4Config(dequantize=True) as {dtype_name(dtype)}, attention {attn}, on {where}")
    model = AutoModelForCausalLM.from_pretrained(
        path, quantization_config=Mxfp4Config(dequantize=True), dtype=dtype, attn_implementation=attn,
        device_map=device_map)
    # Generation keeps its KV cache although gradient checkpointing is on for training (TRL's generation_kwargs).
    model.config.use_cache = True
    return model


def check_visible_gpus(gpus: int, processes: int) -> None:
    """One process must see one GPU: the Trainer would wrap the model in nn.DataParallel, which TRL refuses."""
    from tes_grpo.script_config import SettingsError

    if processes == 1 and gpus > 1:
        raise SettingsError(f"{gpus} GPUs are visible to one process. Train on one of them with CUDA_VISIBLE_DEVICES=0 "
                            "python train_grpo.py ..., or on all of them with accelerate launch --config_file "
                            "configs/accelerate/ddp.yaml (or fsdp2.yaml) train_grpo.py ...")


def check_machine(use_vllm: bool, say=print) -> None:
    """One GPU per process, and vLLM installed when asked for; says which optional extras are installed."""
    import importlib.util

    import torch

    from tes_grpo.processes import process_count
    from tes_grpo.script_config import SettingsError

    check_visible_gpus(torch.cuda.device_count(), process_count())
    have = {name: importlib.util.find_spec(name) is not None for name in ("vllm", "kernels", "liger_kernel")}
    if use_vllm and not have["vllm"]:
        raise SettingsError("USE_VLLM=1 needs vllm (pip install -r requirements-gpu.txt); it is not installed")
    say("optional extras installed: " + ", ".join(f"{k}={'yes' if v else 'no'}" for k, v in have.items())
        + " (kernels/liger are not used by this script)")
