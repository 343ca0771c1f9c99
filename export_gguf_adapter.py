"""Write a PEFT LoRA adapter for gpt-oss as a GGUF LoRA adapter (llama.cpp's format, usable by Ollama's ADAPTER).

    python export_gguf_adapter.py --ADAPTER_PATH=runs/grpo-gpt-oss-20b --OUT_PATH=runs/export/gpt-oss-tes-lora.gguf

The file has `general.type = adapter`, `adapter.type = lora`, `general.architecture = gpt-oss`,
`adapter.lora.alpha`, and for each adapted attention projection `blk.N.attn_{q,k,v,output}.weight.lora_a`
(PEFT's lora_A, `[rank, in]`) and `.lora_b` (lora_B, `[out, rank]`), the layout llama.cpp's
`convert_lora_to_gguf.py` writes. gpt-oss's attention weights are not permuted by llama.cpp's converter,
so the factors go in unchanged. llama.cpp scales by alpha / rank; rsLoRA and per-module rank/alpha
patterns are folded into lora_b so the effective update matches PEFT's.

LoRA on the MoE experts (PEFT `target_parameters`) has no GGUF adapter form for gpt-oss's fused,
interleaved gate_up tensors: such an adapter is refused (use the merged MXFP4 export instead), or with
`--SKIP_EXPERT_LORA` written without its expert part, which is printed.
"""

from __future__ import annotations

import math
import re
import sys
import typing
from pathlib import Path

from tes_grpo.run import (  # the module: its UPPER_CASE names imported here would become settings
    adapter_folder,
    run_folder,
)
from tes_grpo.run.fileio import InputError

if typing.TYPE_CHECKING:  # annotations only; the module is imported where it is used
    import torch

ADAPTER_PATH = "runs/grpo-gpt-oss-20b"  # PEFT LoRA folder (adapter_config.json + adapter_model.safetensors)
OUT_PATH = "runs/export/gpt-oss-tes-lora.gguf"  # GGUF file to write (replaced atomically)
OUTTYPE = "f16"  # tensor type in the file: f32, f16 or bf16 (llama.cpp's converter defaults to f16)
SKIP_EXPERT_LORA = False  # drop expert (target_parameters) LoRA factors instead of refusing the adapter
OVERWRITE = False  # replace an existing OUT_PATH

_ARCH = "gpt-oss"  # llama.cpp's architecture name for gpt-oss (gguf.MODEL_ARCH.GPT_OSS)
_LORA_KEY = re.compile(r"^base_model\.model\.(?P<module>.+?)\.(?P<part>lora_A|lora_B)\.weight$")
_EXPERT_MODULE = re.compile(r"\.mlp\.experts(\.base_layer)*$")


class GGUFExportError(RuntimeError):
    """The adapter cannot be written as a GGUF LoRA; the message says why."""


def lora_factors(adapter_path: Path) -> tuple[dict, dict[str, dict[str, "torch.Tensor"]]]:
    """(adapter_config, {module path: {"lora_A": tensor, "lora_B": tensor}}) read from a PEFT LoRA folder
    (adapter_folder.lora_adapter_config checks it first)."""
    from safetensors.torch import load_file

    config_path, weights_path = adapter_path / run_folder.ADAPTER_CONFIG, adapter_path / run_folder.ADAPTER_WEIGHTS
    try:
        config = adapter_folder.lora_adapter_config(adapter_path)
    except InputError as err:
        raise GGUFExportError(str(err)) from None
    for option in ("use_dora", "lora_bias"):
        if config.get(option):
            raise GGUFExportError(f"{config_path}: {option}=True has no GGUF LoRA form")
    if config.get("modules_to_save"):
        raise GGUFExportError(f"{config_path}: modules_to_save {config['modules_to_save']} are full weights, "
                              f"not LoRA; use the merged export")
    modules: dict[str, dict] = {}
    for key, tensor in load_file(str(weights_path)).items():
        match = _LORA_KEY.match(key)
        if match is None:
            raise GGUFExportError(f"{weights_path}: tensor {key} is not a LoRA factor; cannot convert")
        modules.setdefault(match["module"], {})[match["part"]] = tensor
    return config, modules


def module_scale(config: dict, module: str, rank: int) -> float:
    """PEFT's scaling for `module`: alpha / r (or alpha / sqrt(r) with rsLoRA), patterns applied."""
    alpha = config["lora_alpha"]
    for pattern, value in (config.get("alpha_pattern") or {}).items():
        if re.search(rf"(^|\.){pattern}$", module):
            alpha = value
    return alpha / math.sqrt(rank) if config.get("use_rslora") else alpha / rank


def gguf_tensor_base(name_map, module: str) -> str:
    """`model.layers.3.self_attn.q_proj` -> `blk.3.attn_q.weight` via gguf's own gpt-oss name map."""
    name = name_map.get_name(module)
    if name is None:
        raise GGUFExportError(f"no GGUF tensor for module {module} in gguf's {_ARCH} name map")
    return f"{name}.weight"


def write_gguf_lora(adapter_path: str | Path, out_path: str | Path, outtype: str = OUTTYPE,
                    skip_expert_lora: bool = False) -> dict:
    """Writes the GGUF LoRA; returns {"tensors": {name: numpy shape}, "alpha": float, "skipped": [...]}."""
    import gguf
    import numpy as np
    import torch

    from tes_grpo.run.fileio import atomic_output

    dtypes = {"f32": np.float32, "f16": np.float16}
    if outtype not in (*dtypes, "bf16"):
        raise GGUFExportError(f"OUTTYPE {outtype!r}: use f32, f16 or bf16")
    adapter_path, out_path = Path(adapter_path), Path(out_path)
    config, modules = lora_factors(adapter_path)
    experts = sorted(m for m in modules if _EXPERT_MODULE.search(m))
    if experts and not skip_expert_lora:
        raise GGUFExportError(f"the adapter adapts MoE expert weights ({', '.join(experts)}): a GGUF LoRA cannot "
                              f"hold them for gpt-oss. Serve the merged MXFP4 export (export_quantized_model.py), "
                              f"or pass --SKIP_EXPERT_LORA to write the attention part only")
    if experts:
        print(f"SKIPPING expert LoRA (--SKIP_EXPERT_LORA): {', '.join(experts)}; the GGUF adapter holds attention only")
    layers = 1 + max((int(m) for m in re.findall(r"\.layers\.(\d+)\.", " ".join(modules))), default=0)
    name_map = gguf.get_tensor_name_map(gguf.MODEL_ARCH.GPT_OSS, layers)
    alpha = float(config["lora_alpha"])
    writer_tensors = {}
    for module in sorted(set(modules) - set(experts)):
        factors = modules[module]
        if set(factors) != {"lora_A", "lora_B"}:
            raise GGUFExportError(f"{module}: has {sorted(factors)}, needs both lora_A and lora_B")
        lora_a, lora_b = factors["lora_A"].float(), factors["lora_B"].float()
        rank = lora_a.shape[0]
        if lora_b.shape[1] != rank:
            raise GGUFExportError(f"{module}: lora_A {tuple(lora_a.shape)} and lora_B {tuple(lora_b.shape)} "
                                  f"disagree on rank")
        # llama.cpp applies alpha / rank with the file's single alpha; fold any other PEFT scaling into lora_b
        lora_b = lora_b * (module_scale(config, module, rank) / (alpha / rank))
        base = gguf_tensor_base(name_map, module)
        writer_tensors[f"{base}.lora_a"] = lora_a
        writer_tensors[f"{base}.lora_b"] = lora_b
    if not writer_tensors:
        raise GGUFExportError(f"{adapter_path}: no attention LoRA factors to write")
    with atomic_output(out_path, suffix=".gguf") as tmp:
        writer = gguf.GGUFWriter(str(tmp), _ARCH)
        writer.add_type(gguf.GGUFType.ADAPTER)
        writer.add_string(gguf.Keys.Adapter.TYPE, "lora")
        writer.add_float32(gguf.Keys.Adapter.LORA_ALPHA, alpha)
        writer.add_name(f"{adapter_path.name} LoRA")
        for name, tensor in writer_tensors.items():
            if outtype == "bf16":
                raw = tensor.to(torch.bfloat16).view(torch.int16).numpy()
                writer.add_tensor(name, raw, raw_shape=raw.shape, raw_dtype=gguf.GGMLQuantizationType.BF16)
            else:
                writer.add_tensor(name, tensor.numpy().astype(dtypes[outtype]))
        writer.write_header_to_file()
        writer.write_kv_data_to_file()
        writer.write_tensors_to_file()
        writer.close()
    return {"tensors": {name: tuple(t.shape) for name, t in writer_tensors.items()}, "alpha": alpha,
            "skipped": experts, "path": str(out_path)}


def main(argv: list[str] | None = None) -> int:
    from tes_grpo.run.script_config import resolve

    settings = resolve(globals(), argv)
    try:
        if Path(settings.OUT_PATH).exists() and not settings.OVERWRITE:
            raise GGUFExportError(f"{settings.OUT_PATH} already exists; pass --OVERWRITE to replace it")
        result = write_gguf_lora(settings.ADAPTER_PATH, settings.OUT_PATH, settings.OUTTYPE,
                                 settings.SKIP_EXPERT_LORA)
    except GGUFExportError as err:
        print(f"error: {err}", file=sys.stderr)
        return 1
    print(f"wrote {result['path']}: {len(result['tensors'])} tensors, alpha {result['alpha']}, type {settings.OUTTYPE}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
