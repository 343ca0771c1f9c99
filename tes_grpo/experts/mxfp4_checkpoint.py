"""MXFP4 checkpoint files in OpenAI's gpt-oss layout: reading a safetensors folder lazily, writing the MXFP4
checkpoint (expert weights as blocks and scales, the rest bf16, sharded like the hub's), its config.json and the
tokenizer files.

Library module, not a script. The tiny-model builder and `export_quantized_model.py` write checkpoints with it, the
loaders (model_loading.py) read them; the values go through the codec in mxfp4.py:
    from tes_grpo.experts.mxfp4_checkpoint import SafetensorsCheckpoint, write_mxfp4_checkpoint

A transformers `GptOss` parameter `model.layers.N.mlp.experts.gate_up_proj` (or `down_proj`, [experts, in, out])
is stored as `..._blocks` and `..._scales` ([experts, out, in/32, 16] and [experts, out, in/32]: EXPERT_PARAM_RE and
CHECKPOINT_EXPERT_RE name the two spellings).
"""

from __future__ import annotations

import json
import os
import re
from collections.abc import Iterator, Mapping
from pathlib import Path

import torch
from safetensors import safe_open
from safetensors.torch import save_file

from tes_grpo.experts.mxfp4 import BLOCK_SIZE, expert_param_to_mxfp4

# openai/gpt-oss-20b and -120b config.json: everything but the MoE experts stays bf16.
MODULES_TO_NOT_CONVERT = ["model.layers.*.self_attn", "model.layers.*.mlp.router", "model.embed_tokens", "lm_head"]
EXPERT_PARAM_RE = re.compile(r"^(?P<prefix>.*\.mlp\.experts)\.(?P<proj>gate_up_proj|down_proj)$")
CHECKPOINT_EXPERT_RE = re.compile(
    r"^(?P<prefix>.*\.mlp\.experts)\.(?P<proj>gate_up_proj|down_proj)_(?P<part>blocks|scales)$")
DEFAULT_MAX_SHARD_BYTES = 5 * 1024**3  # same shard size as the hub checkpoints


class SafetensorsCheckpoint(Mapping):
    """Read-only, lazy `{name: tensor}` view of a safetensors checkpoint folder (single file or sharded).

    Lets the exporter copy the base model's expert blocks/scales bit for bit without loading 13 GB.
    """
    def __init__(self, folder: str | os.PathLike, only: set[str] | None = None):
        """`only`: restrict the view to these tensor names (others read as absent)."""
        self.folder = Path(folder)
        index = self.folder / "model.safetensors.index.json"
        if index.is_file():
            weight_map = json.loads(index.read_text(encoding="utf-8"))["weight_map"]
            self._files = {name: self.folder / file for name, file in weight_map.items()}
        else:
            files = sorted(self.folder.glob("*.safetensors"))
            if not files:
                raise FileNotFoundError(f"{self.folder}: no *.safetensors files")
            self._files = {}
            for file in files:
                with safe_open(str(file), framework="pt") as handle:
                    self._files.update({name: file for name in handle.keys()})
        if only is not None:
            self._files = {name: file for name, file in self._files.items() if name in only}

    def __getitem__(self, name: str) -> torch.Tensor:
        with safe_open(str(self._files[name]), framework="pt") as handle:
            return handle.get_tensor(name)

    def shape(self, name: str) -> tuple[int, ...]:
        with safe_open(str(self._files[name]), framework="pt") as handle:
            return tuple(handle.get_slice(name).get_shape())

    def __contains__(self, name) -> bool:  # Mapping's default would read the tensor
        return name in self._files

    def __iter__(self) -> Iterator[str]:
        return iter(self._files)

    def __len__(self) -> int:
        return len(self._files)


def legacy_config_keys(data: Mapping) -> dict:
    """The config.json keys of openai/gpt-oss-20b that transformers 5's `to_dict()` no longer writes.

    transformers 5 keeps RoPE only as `rope_parameters` (theta inside) and drops the original checkpoint's
    `rope_theta`, `rope_scaling` and `experts_per_token`, but other readers still take exactly those: Ollama's
    gpt-oss converter (convert/convert_gptoss.go) reads `rope_theta` (-> rope.freq_base), `rope_scaling.{rope_type,
    factor, original_max_position_embeddings, beta_fast, beta_slow}`, `experts_per_token` (-> expert_used_count) and
    `initial_context_length`, and `architectures[0]` picks its converter; a missing key silently becomes 0 there.
    Derived from the config's own values, so the two spellings cannot disagree; transformers 5 reads them back into
    the same `rope_parameters` (its `rope_scaling` wins over `rope_parameters`, `rope_theta` fills the theta in).
    """
    rope = data.get("rope_parameters")
    if isinstance(rope, Mapping) and "rope_theta" in rope and not isinstance(rope["rope_theta"], Mapping):
        theta = rope["rope_theta"]
        scaling = {key: value for key, value in rope.items() if key != "rope_theta"}
    elif data.get("rope_theta") is not None:  # an older transformers: the legacy keys are already there
        theta, scaling = data["rope_theta"], data.get("rope_scaling")
    else:
        raise ValueError(f"config has no RoPE theta (rope_parameters={rope!r}, rope_theta={data.get('rope_theta')!r}): "
                         f"cannot write rope_theta / rope_scaling for Ollama")
    keys = {"architectures": data.get("architectures") or ["GptOssForCausalLM"], "rope_theta": theta,
            "experts_per_token": data["num_experts_per_tok"]}  # the value transformers routes with
    if scaling:
        keys["rope_scaling"] = dict(scaling)
        original = scaling.get("original_max_position_embeddings")
        if original is not None:
            keys["initial_context_length"] = data.get("initial_context_length") or original
    return keys


def mxfp4_config_dict(config) -> dict:
    """config.json content: the model config plus gpt-oss's MXFP4 `quantization_config` and the original
    checkpoint's RoPE / expert keys (`legacy_config_keys`), so Ollama's converter reads it like openai/gpt-oss-20b."""
    data = dict(config) if isinstance(config, Mapping) else config.to_dict()
    data.update(legacy_config_keys(data))
    data["quantization_config"] = {"quant_method": "mxfp4", "modules_to_not_convert": list(MODULES_TO_NOT_CONVERT)}
    data["torch_dtype"] = data["dtype"] = "bfloat16"
    return data


def write_config_json(config, out_dir: str | os.PathLike) -> Path:
    """Writes `out_dir/config.json` (mxfp4_config_dict) as the checkpoint writer does; returns its path."""
    path = Path(out_dir) / "config.json"
    path.write_text(json.dumps(mxfp4_config_dict(config), indent=2, sort_keys=True) + "\n", encoding="utf-8")
    return path


def save_tokenizer_files(tokenizer, out_dir: str | os.PathLike) -> None:
    """tokenizer.save_pretrained plus the chat template inside tokenizer_config.json as well.

    transformers 5 writes the template only to chat_template.jinja, but Ollama's converter takes it only from
    tokenizer_config.json's `chat_template` (convert/tokenizer.go), and without it Ollama has no template to
    recognise as Harmony. transformers reads either file and they hold the same text.
    """
    out_dir = Path(out_dir)
    tokenizer.save_pretrained(out_dir)
    template = tokenizer.chat_template
    if not isinstance(template, str) or not template:
        raise ValueError("the tokenizer has no chat template (gpt-oss's Harmony template is needed for serving)")
    config_path = out_dir / "tokenizer_config.json"
    config = json.loads(config_path.read_text(encoding="utf-8"))
    config["chat_template"] = template
    config_path.write_text(json.dumps(config, indent=2, ensure_ascii=False) + "\n", encoding="utf-8")


def checkpoint_tensors(state_dict: Mapping[str, torch.Tensor], passthrough: Mapping[str, torch.Tensor] | None = None,
                       dtype: torch.dtype = torch.bfloat16,
                       stats: dict | None = None) -> Iterator[tuple[str, torch.Tensor]]:
    """Yields (checkpoint name, tensor) in gpt-oss's layout for a transformers `GptOss` state dict.

    Expert weights become `*_blocks` / `*_scales`: copied from `passthrough` (checkpoint names) when
    it holds both, else quantized. Floating tensors are cast to `dtype`; `stats` counts each kind.
    """
    passthrough = passthrough or {}
    stats = stats if stats is not None else {}
    for name, tensor in state_dict.items():
        match = EXPERT_PARAM_RE.match(name)
        if match is None:
            stats["bf16"] = stats.get("bf16", 0) + 1
            yield name, (tensor.detach().to(dtype) if tensor.is_floating_point() else tensor.detach())
            continue
        if tensor.dim() != 3:
            raise ValueError(f"{name}: expected a 3-D expert parameter [experts, in, out], got {tuple(tensor.shape)}")
        blocks_name, scales_name = f"{name}_blocks", f"{name}_scales"
        if blocks_name in passthrough and scales_name in passthrough:
            blocks, scales = passthrough[blocks_name], passthrough[scales_name]
            experts, inner, outer = tensor.shape
            expected = (experts, outer, inner // BLOCK_SIZE, BLOCK_SIZE // 2)
            if tuple(blocks.shape) != expected or tuple(scales.shape) != expected[:-1]:
                raise ValueError(f"{blocks_name}: passthrough blocks {tuple(blocks.shape)} / scales "
                                 f"{tuple(scales.shape)} do not fit the parameter {tuple(tensor.shape)}")
            stats["copied"] = stats.get("copied", 0) + 1
        else:
            blocks, scales = expert_param_to_mxfp4(tensor)
            stats["quantized"] = stats.get("quantized", 0) + 1
        yield blocks_name, blocks.contiguous()
        yield scales_name, scales.contiguous()


def estimate_checkpoint_bytes(state_dict: Mapping[str, torch.Tensor]) -> int:
    """Bytes the MXFP4 checkpoint will take: 17 bytes per 32 expert values, 2 bytes per other value."""
    total = 0
    for name, tensor in state_dict.items():
        if EXPERT_PARAM_RE.match(name):
            total += tensor.numel() // BLOCK_SIZE * (BLOCK_SIZE // 2 + 1)
        else:
            total += tensor.numel() * (2 if tensor.is_floating_point() else tensor.element_size())
    return total


class ShardWriter:
    """Collects tensors into safetensors shards of at most `max_shard_bytes`, named like the hub's."""
    def __init__(self, out_dir: Path, max_shard_bytes: int):
        self.out_dir, self.max_shard_bytes = Path(out_dir), max_shard_bytes
        self.current: dict[str, torch.Tensor] = {}
        self.current_bytes = 0
        self.temp_files: list[Path] = []
        self.shard_of: dict[str, int] = {}
        self.total = 0

    def add(self, name: str, tensor: torch.Tensor) -> None:
        size = tensor.numel() * tensor.element_size()
        if self.current and self.current_bytes + size > self.max_shard_bytes:
            self._flush()
        self.current[name] = tensor
        self.shard_of[name] = len(self.temp_files)
        self.current_bytes += size
        self.total += size

    def _flush(self) -> None:
        path = self.out_dir / f".shard-{len(self.temp_files):05d}.safetensors.tmp"
        save_file(self.current, str(path), metadata={"format": "pt"})
        self.temp_files.append(path)
        self.current, self.current_bytes = {}, 0

    def finish(self) -> list[str]:
        """Writes the last shard, gives the shards their final names (+ index when sharded); returns the names."""
        self._flush()
        count = len(self.temp_files)
        names = (["model.safetensors"] if count == 1
                 else [f"model-{i + 1:05d}-of-{count:05d}.safetensors" for i in range(count)])
        for temp, final in zip(self.temp_files, names, strict=True):
            os.replace(temp, self.out_dir / final)
        if count > 1:
            index = {"metadata": {"total_size": self.total},
                     "weight_map": {k: names[i] for k, i in sorted(self.shard_of.items())}}
            (self.out_dir / "model.safetensors.index.json").write_text(json.dumps(index, indent=2) + "\n",
                                                                       encoding="utf-8")
        return names


def write_mxfp4_checkpoint(model_or_state_dict, config, out_dir: str | os.PathLike, *,
                           passthrough: Mapping[str, torch.Tensor] | None = None,
                           max_shard_bytes: int = DEFAULT_MAX_SHARD_BYTES,
                           dtype: torch.dtype = torch.bfloat16) -> dict:
    """Writes `model.safetensors` (or shards + index) and `config.json` in openai/gpt-oss's MXFP4 layout.

    `model_or_state_dict`: a `GptOssForCausalLM` (bf16, dequantized) or its state dict.
    `config`: its `GptOssConfig` or a dict. `passthrough`: checkpoint-named `*_blocks`/`*_scales`
    tensors (e.g. a `SafetensorsCheckpoint` of the base) copied bit for bit instead of re-quantizing.
    Writes into `out_dir` directly (callers wanting atomicity pass a temp folder and rename it).
    Returns {"files": [...], "copied": n, "quantized": n, "bf16": n, "bytes": total}.
    """
    state_dict = model_or_state_dict if isinstance(model_or_state_dict, Mapping) else model_or_state_dict.state_dict()
    config_data = mxfp4_config_dict(config)
    if config_data.get("tie_word_embeddings") and "lm_head.weight" in state_dict:
        state_dict = {k: v for k, v in state_dict.items() if k != "lm_head.weight"}
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    stats: dict = {"copied": 0, "quantized": 0, "bf16": 0}
    writer = ShardWriter(out_dir, max_shard_bytes)
    for name, tensor in checkpoint_tensors(state_dict, passthrough, dtype, stats):
        writer.add(name, tensor)
    names = writer.finish()
    write_config_json(config_data, out_dir)
    return {"files": names, "bytes": writer.total, **stats}


__all__ = [
    "CHECKPOINT_EXPERT_RE", "EXPERT_PARAM_RE", "MODULES_TO_NOT_CONVERT", "SafetensorsCheckpoint", "ShardWriter",
    "checkpoint_tensors", "estimate_checkpoint_bytes", "legacy_config_keys", "mxfp4_config_dict",
    "save_tokenizer_files", "write_config_json", "write_mxfp4_checkpoint",
]
