"""Where and how a gpt-oss checkpoint is loaded (one home).

train_grpo.py, llm_policy.py (test_lora_adapter.py, evaluate_policy.py), export_quantized_model.py and
run_exported_model.py all decide these the same way here:
- device "auto": the GPU when torch sees one, else the CPU;
- dtype "auto": bfloat16 on a GPU, float32 on the CPU (bf16 matrix products are slow on most CPUs, and the tiny
  model is small);
- attention "auto": flex_attention on CUDA (it supports gpt-oss's attention sinks; sdpa and flash-attention 2 do
  not), eager on the CPU;
- the experts' form (resident MXFP4 or dequantized), the training loader (load_training_model) and the evaluation
  scripts' loader (load_for_inference).

What a run folder says about its adapter and settings (adapter_config.json, train_config.json) is read by
run_folder.py. This module imports torch and transformers: the scripts import it inside the functions that load a
model, after their settings are parsed, so their --help stays quick.
"""

from __future__ import annotations

import copy
import importlib.util
from pathlib import Path

import torch
from accelerate import init_empty_weights
from huggingface_hub import snapshot_download
from transformers import AutoConfig, AutoModelForCausalLM, GenerationConfig, Mxfp4Config
from transformers.integrations.mxfp4 import Mxfp4GptOssExperts
from transformers.utils import is_kernels_available, is_triton_available

from tes_grpo.experts.mxfp4_checkpoint import CHECKPOINT_EXPERT_RE, SafetensorsCheckpoint
from tes_grpo.experts.mxfp4_dequant import dequantize_experts
from tes_grpo.experts.mxfp4_experts import (
    ResidentSummary,
    expected_shapes,
    expert_layer_index,
    is_resident,
    make_resident,
    put_checkpoint_tensor,
    residency_line,
    resident_state,
)
from tes_grpo.model.tiny_model import ensure_tiny_checkpoint
from tes_grpo.patches.transformers_patches import dequantized_experts_in_dtype, quiet_mxfp4_fallback_warnings
from tes_grpo.run.choices import EXPERTS_CHOICES
from tes_grpo.run.presets import TINY_MODEL_ID
from tes_grpo.run.processes import (
    is_main_process,
    local_rank,
    process_count,
    process_rank,
    uses_fsdp,
    wait_for_everyone,
)
from tes_grpo.run.script_config import SettingsError
from tes_grpo.task.harmony import load_tokenizer, tokenizer_source

DEVICES = ("auto", "cpu", "cuda")
DTYPES = ("auto", "bfloat16", "float32", "float16")


def cuda_available() -> bool:
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
    if dtype not in DTYPES:
        raise ValueError(f"DTYPE must be one of {', '.join(DTYPES)}, got {dtype!r}")
    if dtype == "auto":
        return torch.bfloat16 if device == "cuda" else torch.float32
    return getattr(torch, dtype)


def dtype_name(torch_dtype) -> str:
    return str(torch_dtype).removeprefix("torch.")


def checkpoint_is_mxfp4(model_id, config=None) -> bool:
    """Whether a checkpoint's config declares MXFP4 (openai/gpt-oss-* and the tiny model do); read before loading,
    because transformers drops the quantization config when it dequantizes. config: the checkpoint's config when
    the caller has read it already (AutoConfig.from_pretrained(model_id)), else it is read here."""
    if config is None:
        config = AutoConfig.from_pretrained(model_id)
    quantization = getattr(config, "quantization_config", None) or {}
    method = (quantization.get("quant_method") if isinstance(quantization, dict)
              else getattr(quantization, "quant_method", None))
    return str(getattr(method, "value", method)) == "mxfp4"


def native_mxfp4_blockers(device: str) -> list[str]:
    """Why transformers' native MXFP4 path (experts kept quantized) cannot run here; empty when it can."""
    reasons = []
    if device != "cuda":
        reasons.append("no GPU (on the CPU transformers runs MXFP4 only through hub kernels, use_kernels=True)")
    if not is_triton_available():
        reasons.append("triton is not installed")
    if not is_kernels_available():
        reasons.append("the `kernels` package (a version this transformers accepts) is not installed")
    return reasons


def load_tokenizer_for(model_path, say=print):
    """The checkpoint's own tokenizer, or harmony's (same vocabulary) when its local folder has none; either way its
    special token ids are checked (harmony.load_tokenizer)."""
    folder = Path(model_path)
    if folder.is_dir() and not (folder / "tokenizer.json").is_file():
        say(f"tokenizer: {tokenizer_source()} (no tokenizer.json in {folder})")
        return load_tokenizer()
    return load_tokenizer(str(model_path))


# ---------------------------------------------------------------------------------------------------------------
# The policy for training (train_grpo.py): dequantized MXFP4, one process per GPU or FSDP
# ---------------------------------------------------------------------------------------------------------------

def resolve_model_path(model_id: str) -> str:
    """MODEL_ID as from_pretrained takes it; "tiny" builds the tiny checkpoint (once, rank 0 first) -> its folder."""
    if model_id != TINY_MODEL_ID:
        return model_id
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


def _dequantized_config(path, config=None):
    """The checkpoint's config as the dequantized model has it (no quantization_config): a copy of `config` when the
    caller read it already (the caller's is never changed), else read from path."""
    config = AutoConfig.from_pretrained(path) if config is None else copy.deepcopy(config)
    if getattr(config, "quantization_config", None) is not None:
        del config.quantization_config  # as after Mxfp4Config(dequantize=True): plain bf16 experts
    return config


def empty_policy_model(path: str, dtype, attn: str, experts: str = "bf16", keep_bf16_layers=None, config=None):
    """The dequantized model's structure with its parameters on the meta device (buffers such as the rotary
    frequencies are real: FSDP does not broadcast non-persistent buffers). experts="mxfp4": the experts resident
    (mxfp4_experts.py) as load_resident_model makes them, but those of keep_bf16_layers ({layer: why}); their
    blocks and scales are buffers too, read from the checkpoint onto the CPU. config: the checkpoint's config if
    read already (a copy is changed here, never the caller's)."""
    config = _dequantized_config(path, config)
    if experts == "mxfp4":
        model = resident_skeleton(config, dtype, attn, keep_bf16_layers or {})
        fill_resident_experts(model, checkpoint_folder(path), "cpu")
        return model
    with init_empty_weights(include_buffers=False):
        model = AutoModelForCausalLM.from_config(config, dtype=dtype, attn_implementation=attn)
    model.config.use_cache = True
    return model


def load_training_model(path: str, attn_implementation: str = "auto", dtype=None, say=print, experts: str = "auto",
                        expert_lora_layers=(), config=None):
    """An MXFP4 gpt-oss checkpoint loaded for LoRA training: its experts resident as MXFP4 (load_resident_model) or
    dequantized (`Mxfp4Config(dequantize=True)`), as resolve_experts decides for `experts` (auto | mxfp4 | bf16) and
    the layers whose experts get LoRA (expert_lora_layers: those keep bf16 experts).

    dtype and attention follow resolve_dtype/resolve_attention ("auto"). On the GPU when there is one; under FSDP
    on the CPU on rank 0 and without weights on the other ranks (loads_weights_here). config: the checkpoint's
    config (AutoConfig.from_pretrained(path)) when the caller has read it, so that config.json is read once.
    """
    config = AutoConfig.from_pretrained(path) if config is None else config
    device = resolve_device("auto")
    cuda = device == "cuda"
    attn = resolve_attention(attn_implementation, device)
    dtype = dtype or resolve_dtype("auto", device)
    fsdp, processes = uses_fsdp(), process_count()
    experts, experts_why = resolve_experts(experts, path, expert_lora_layers, config)
    keep = {i: "LoRA on their experts: LORA_EXPERT_LAYERS" for i in expert_lora_layers}
    if not loads_weights_here(cuda, fsdp, processes, process_rank()):
        return empty_policy_model(path, dtype, attn, experts, keep, config)
    device_map = model_device_map(cuda, fsdp, processes, local_rank())
    where = "cpu" if device_map is None else f"cuda:{local_rank()}"
    if cuda and device_map is None:
        where += ", then sharded onto the GPUs by FSDP"
    if experts == "mxfp4":
        say(f"loading {path} with its experts resident as MXFP4 ({experts_why}), the rest as {dtype_name(dtype)}, "
            f"attention {attn}, on {where}")
        return load_resident_model(path, dtype, attn, "cpu" if device_map is None else f"cuda:{local_rank()}",
                                   keep, say, config)
    say(f"loading {path} with Mxfp4Config(dequantize=True) as {dtype_name(dtype)}, attention {attn}, on {where} "
        f"({experts_why})")
    model = load_dequantized(path, dtype, attn, device_map, say, config=config)
    # Generation keeps its KV cache although gradient checkpointing is on for training (TRL's generation_kwargs).
    model.config.use_cache = True
    return model


# ---------------------------------------------------------------------------------------------------------------
# Resident MXFP4 experts (mxfp4_experts.py): loaded from the checkpoint's blocks and scales, never built in bf16
# ---------------------------------------------------------------------------------------------------------------

def resolve_experts(experts: str, path: str, expert_lora_layers=(), config=None) -> tuple[str, str]:
    """("mxfp4" or "bf16", why) for EXPERTS: mxfp4 = the experts stay resident as the checkpoint's MXFP4 blocks
    (mxfp4_experts.py), bf16 = dequantized at load. auto: mxfp4 for an MXFP4 checkpoint without LoRA on the
    experts, else bf16. mxfp4 with expert LoRA: those layers alone keep bf16 experts. config: the checkpoint's
    config if read already (checkpoint_is_mxfp4)."""
    if experts not in EXPERTS_CHOICES:
        raise SettingsError(f"EXPERTS={experts!r}: must be one of {', '.join(EXPERTS_CHOICES)}")
    if experts == "bf16":
        return "bf16", "EXPERTS=bf16"
    mxfp4 = checkpoint_is_mxfp4(path, config)
    if experts == "mxfp4":
        if not mxfp4:
            raise SettingsError(f"EXPERTS=mxfp4 needs an MXFP4 checkpoint; the config of {path} declares no MXFP4 "
                                "quantization (EXPERTS=bf16 or auto load it as it is)")
        return "mxfp4", "EXPERTS=mxfp4"
    if not mxfp4:
        return "bf16", "EXPERTS=auto: the checkpoint is not MXFP4"
    if list(expert_lora_layers):
        return "bf16", (f"EXPERTS=auto: LoRA on the experts of layers {list(expert_lora_layers)}, so all experts "
                        "dequantized (EXPERTS=mxfp4 keeps only those layers bf16)")
    return "mxfp4", "EXPERTS=auto: MXFP4 checkpoint, no LoRA on the experts"


def checkpoint_folder(path: str) -> Path:
    """The local folder of a checkpoint: `path` itself, or the hub cache's snapshot of a hub id (downloaded there
    if missing, as from_pretrained would)."""
    folder = Path(path)
    if folder.is_dir():
        return folder
    return Path(snapshot_download(str(path), allow_patterns=[
        "config.json", "generation_config.json", "model*.safetensors", "model.safetensors.index.json"]))


def resident_skeleton(config, dtype, attn: str, keep_bf16_layers):
    """empty_policy_model for experts="mxfp4": the structure built on the meta device (all of it:
    init_empty_weights alone would allocate each parameter, bf16 experts included, before moving it there), the
    experts made resident with meta blocks/scales but those of keep_bf16_layers ({layer: why}), and the buffers (the
    rotary frequencies) computed for real on the CPU by the model's own init (transformers 5.17-5.24's private
    _init_weights: PreTrainedModel's computes a rotary embedding's inv_freq)."""
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config, dtype=dtype, attn_implementation=attn)
    for module in model.modules():
        meta = [key for key, buffer in module._buffers.items() if buffer is not None and buffer.is_meta]
        for key in meta:
            module._buffers[key] = torch.empty_like(module._buffers[key], device="cpu")
        if meta:
            model._init_weights(module)  # transformers' init computes the rotary frequencies into them
    for name, module in list(model.named_modules()):  # after: the blocks and scales are buffers left on meta
        index = expert_layer_index(name)
        if index is not None and index not in keep_bf16_layers and hasattr(module, "num_experts"):
            make_resident(module, {key: torch.empty(shape, dtype=torch.uint8, device="meta")
                                   for key, shape in expected_shapes(module).items()}, module.gate_up_proj.dtype)
    model.config.use_cache = True
    return model


def fill_resident_experts(model, folder, device) -> None:
    """Reads the resident experts' blocks and scales of a skeleton (resident_skeleton) from the checkpoint in
    `folder` onto `device`."""
    checkpoint = SafetensorsCheckpoint(folder)
    modules = dict(model.named_modules())
    for name in resident_state(model):
        if name not in checkpoint:
            raise ValueError(f"{folder}: the checkpoint lacks {name}")
        module_name, _, attr = name.rpartition(".")
        _place(modules[module_name], attr, checkpoint[name], device, name)


def _place(module, attr: str, tensor, device, name: str) -> None:
    """Puts a checkpoint tensor into the skeleton's parameter or buffer `attr` of `module`, on `device`, in the
    skeleton's dtype (the dtype from_config gave it); a resident experts module's blocks and scales in its Hopper
    layout (mxfp4_experts.put_checkpoint_tensor)."""
    if is_resident(module) and attr in expected_shapes(module):
        try:
            put_checkpoint_tensor(module, attr, tensor.to(device))
        except ValueError as err:  # its own check of dtype and shape, named by the checkpoint's name
            raise ValueError(f"checkpoint tensor {name}: {err}") from None
        return
    if attr in module._parameters:
        old = module._parameters[attr]
    elif attr in module._buffers:
        old = module._buffers[attr]
    else:
        raise ValueError(f"checkpoint tensor {name} has no parameter or buffer to go to in the model")
    if tuple(tensor.shape) != tuple(old.shape):
        raise ValueError(f"checkpoint tensor {name}: shape {tuple(tensor.shape)}, the model has {tuple(old.shape)}")
    value = tensor.to(device).to(old.dtype)
    if attr in module._parameters:
        module._parameters[attr] = torch.nn.Parameter(value, requires_grad=old.requires_grad)
    else:
        module._buffers[attr] = value


def load_resident_model(path: str, dtype, attn: str, device: str = "cpu", keep_bf16_layers=None, say=print,
                        config=None):
    """An MXFP4 gpt-oss checkpoint with its experts resident (mxfp4_experts.py): the checkpoint's blocks/scales on
    `device` as the only copy of the experts, everything else in `dtype`, as transformers 5.17-5.24's from_pretrained
    with Mxfp4Config(dequantize=True) would give it (same values, dtypes, config, generation config, eval mode).

    The model is built on the meta device, then filled one checkpoint tensor at a time (host memory: one tensor),
    so no bf16 expert tensor is ever allocated. keep_bf16_layers ({layer: why}) get ordinary dequantized expert
    parameters instead (experts with LoRA). `say` gets mxfp4_experts.residency_line's line. config: the
    checkpoint's config if read already.
    """
    keep = dict(keep_bf16_layers or {})
    folder = checkpoint_folder(path)
    model = resident_skeleton(_dequantized_config(folder, config), dtype, attn, keep)
    modules = dict(model.named_modules())
    checkpoint = SafetensorsCheckpoint(folder)
    halves: dict[tuple[str, str], dict] = {}  # a bf16-kept layer's blocks or scales, until the other is read
    for name in checkpoint:
        module_name, _, attr = name.rpartition(".")
        module = modules.get(module_name)
        if module is None:
            raise ValueError(f"checkpoint tensor {name} has no module {module_name!r} to go to in the model")
        expert = CHECKPOINT_EXPERT_RE.match(name)
        if expert is not None and not is_resident(module):
            parts = halves.setdefault((module_name, expert["proj"]), {})
            parts[expert["part"]] = checkpoint[name].to(device)
            if len(parts) == 2:
                del halves[(module_name, expert["proj"])]
                weight = dequantize_experts(parts["blocks"], parts["scales"], dtype)
                _place(module, expert["proj"], weight, device, name)
            continue
        _place(module, attr, checkpoint[name], device, name)
    if getattr(model.config, "tie_word_embeddings", False):
        model.tie_weights()
    missing = [n for n, p in [*model.named_parameters(), *model.named_buffers()] if p.is_meta]
    if missing or halves:
        raise ValueError(f"{folder}: the checkpoint lacks {missing[:5] + [f'{m}.{p}' for m, p in halves][:5]}"
                         f"{' ...' if len(missing) + len(halves) > 5 else ''}")
    for module in model.modules():
        for name, buffer in module._buffers.items():
            if buffer is not None and buffer.device != torch.device(device):
                module._buffers[name] = buffer.to(device)
    try:
        model.generation_config = GenerationConfig.from_pretrained(folder)
    except OSError:  # no generation_config.json: from_pretrained keeps the one derived from the config, too
        pass
    model.config._name_or_path = model.name_or_path = str(path)
    model.eval()
    say(residency_line(ResidentSummary.of(model, keep)))
    return model


def load_for_inference(path: str, device: str, dtype, attn: str, experts: str = "auto", expert_lora_layers=(),
                       say=print):
    """(model in eval mode, how its experts were loaded in words, experts resident as MXFP4?) for the evaluation
    scripts: the training loader's choice of experts (resolve_experts), on `device`. An MXFP4 checkpoint keeps its
    experts resident as MXFP4 on any device (load_resident_model; computed as the dequantized load computes them),
    so a model that trained on a GPU evaluates on it too; with LoRA on the experts (expert_lora_layers), or
    experts="bf16", they are dequantized at load; another checkpoint is loaded as stored."""
    if not checkpoint_is_mxfp4(path):
        model = AutoModelForCausalLM.from_pretrained(path, dtype=dtype, device_map=device, attn_implementation=attn)
        return model.eval(), f"not an MXFP4 checkpoint: loaded as stored, in {dtype_name(dtype)}", False
    choice, why = resolve_experts(experts, path, expert_lora_layers)
    if choice == "mxfp4":
        model = load_resident_model(path, dtype, attn, device, say=say)
        return model, f"resident MXFP4 ({why}): the checkpoint's blocks and scales, dequantized per layer", True
    model = load_dequantized(path, dtype, attn, device, say)
    return model.eval(), f"dequantized to {dtype_name(dtype)} while loading ({why})", False


def load_dequantized(path: str, dtype, attn: str, device_map, say=print, config=None):
    """An MXFP4 checkpoint through Mxfp4Config(dequantize=True), its experts in `dtype` (the library may leave
    them bf16: transformers_patches.dequantized_experts_in_dtype)."""
    quiet_mxfp4_fallback_warnings()  # the dequantization asked for is no fallback to warn about
    model = AutoModelForCausalLM.from_pretrained(
        path, config=config, quantization_config=Mxfp4Config(dequantize=True), dtype=dtype, attn_implementation=attn,
        device_map=device_map)
    dequantized_experts_in_dtype(model, dtype, say)
    return model


def check_visible_gpus(gpus: int, processes: int) -> None:
    """One process must see one GPU: the Trainer would wrap the model in nn.DataParallel, which TRL refuses."""
    if processes == 1 and gpus > 1:
        raise SettingsError(f"{gpus} GPUs are visible to one process. Train on one of them with CUDA_VISIBLE_DEVICES=0 "
                            "python train_grpo.py ..., or on all of them with accelerate launch --config_file "
                            "configs/accelerate/ddp.yaml (or fsdp2.yaml) train_grpo.py ...")


def check_machine(use_vllm: bool, say=print) -> None:
    """One GPU per process, and vLLM installed when asked for; says which optional extras are installed."""
    check_visible_gpus(torch.cuda.device_count(), process_count())
    have = {name: importlib.util.find_spec(name) is not None for name in ("vllm", "kernels", "liger_kernel")}
    if use_vllm and not have["vllm"]:
        raise SettingsError("USE_VLLM=1 needs vllm (pip install -r requirements-gpu.txt); it is not installed")
    say("optional extras installed: " + ", ".join(f"{k}={'yes' if v else 'no'}" for k, v in have.items())
        + " (kernels/liger are not used by this script)")


def experts_are_mxfp4(model) -> bool:
    """Whether transformers kept the MoE experts in MXFP4 (its native path swaps in Mxfp4GptOssExperts)."""
    return any(isinstance(module, Mxfp4GptOssExperts) for module in model.modules())


def expert_load_path(model, source_is_mxfp4: bool, dequantize_requested: bool = False) -> str:
    """How transformers loaded a model's MoE experts, in words: kept in MXFP4, or dequantized to bf16 and why."""
    if experts_are_mxfp4(model):
        return "native MXFP4: expert weights stay quantized (triton kernels)"
    if not source_is_mxfp4:
        return "not an MXFP4 checkpoint: experts loaded as stored"
    if dequantize_requested:
        return "dequantized to bf16 as requested (Mxfp4Config(dequantize=True))"
    reasons = native_mxfp4_blockers(resolve_device("auto"))
    return ("FELL BACK: transformers dequantized the MXFP4 experts to bf16 while loading ("
            + ("; ".join(reasons) or "reason not reported") + ")")
