"""The Ollama Modelfile (instructions, paths that exist after an export) and the GGUF LoRA adapter (read back)."""

from __future__ import annotations

import json
import math
import re
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

import export_gguf_adapter as gguf_export
import export_quantized_model as export
from test_export import build_tiny_adapter, build_tiny_base

REPO = Path(__file__).resolve().parents[1]
# Ollama's Modelfile instructions and the PARAMETER names its docs list
INSTRUCTIONS = {"FROM", "PARAMETER", "TEMPLATE", "SYSTEM", "ADAPTER", "LICENSE", "MESSAGE", "REQUIRES"}
PARAMETERS = {"temperature": float, "top_p": float, "top_k": int, "min_p": float, "num_ctx": int, "num_predict": int,
              "repeat_penalty": float, "repeat_last_n": int, "seed": int, "stop": str}
ATTENTION = ("attn_q", "attn_k", "attn_v", "attn_output")


def parse_modelfile(text: str) -> list[tuple[str, str]]:
    """(INSTRUCTION, argument) pairs; comments and blank lines skipped, \"\"\"...\"\"\" arguments joined."""
    entries, lines = [], iter(text.splitlines())
    for line in lines:
        stripped = line.strip()
        if not stripped or stripped.startswith("#"):
            continue
        instruction, _, argument = stripped.partition(" ")
        argument = argument.strip()
        if argument.startswith('"""') and not (len(argument) > 5 and argument.endswith('"""')):
            parts = [argument]
            for more in lines:
                parts.append(more)
                if more.rstrip().endswith('"""'):
                    break
            argument = "\n".join(parts)
        entries.append((instruction.upper(), argument))
    return entries


def commented_instructions(text: str) -> list[tuple[str, str]]:
    """The instructions shown commented out (the alternative GGUF route)."""
    return [(m[1].upper(), m[2].strip()) for m in re.finditer(r"^#\s*(FROM|ADAPTER)\s+(\S+)\s*$", text, re.M)]


@pytest.fixture(scope="module")
def tiny_adapters(tmp_path_factory):
    root = tmp_path_factory.mktemp("gguf")
    base = build_tiny_base(root / "base")
    return {"root": root, "base": base,
            "attention": build_tiny_adapter(base, root / "attention"),
            "experts": build_tiny_adapter(base, root / "experts", ["model.layers.1.mlp.experts.down_proj"])}


def test_modelfile_uses_known_instructions_and_gpt_oss_sampling():
    entries = parse_modelfile((REPO / "Modelfile").read_text())
    assert {instruction for instruction, _ in entries} <= INSTRUCTIONS
    assert [argument for instruction, argument in entries if instruction == "FROM"] == ["./runs/export/gpt-oss-tes-mxfp4"]
    parameters = {}
    for instruction, argument in entries:
        if instruction == "PARAMETER":
            name, value = argument.split(None, 1)
            assert name in PARAMETERS, name
            parameters[name] = PARAMETERS[name](value)
    assert parameters["temperature"] == 1.0 and parameters["top_p"] == 1.0
    assert parameters["num_ctx"] >= 4096  # ~1,400-token prompts plus reasoning and answer


def test_modelfile_paths_match_the_exporters_defaults():
    text = (REPO / "Modelfile").read_text()
    from_path = dict(parse_modelfile(text))["FROM"]
    assert Path(from_path) == Path(export.OUT_DIR)
    assert ("ADAPTER", f"./{gguf_export.OUT_PATH}") in commented_instructions(text)


def test_modelfile_paths_exist_after_an_export(tiny_adapters, tmp_path):
    # a copy of the repo's Modelfile; the exports go where it points, relative to the file as Ollama reads it
    shutil.copy(REPO / "Modelfile", tmp_path / "Modelfile")
    text = (tmp_path / "Modelfile").read_text()
    model_dir = tmp_path / dict(parse_modelfile(text))["FROM"]
    adapter_file = tmp_path / dict(commented_instructions(text))["ADAPTER"]
    assert not model_dir.exists()
    export.run_export(str(tiny_adapters["attention"]), "", str(model_dir))
    gguf_export.write_gguf_lora(tiny_adapters["attention"], adapter_file)
    config = json.loads((model_dir / "config.json").read_text())
    assert config["quantization_config"]["quant_method"] == "mxfp4"
    assert (model_dir / "model.safetensors").is_file() and (model_dir / "tokenizer.json").is_file()
    assert adapter_file.is_file()


def read_gguf(path: Path):
    from gguf import GGUFReader

    reader = GGUFReader(str(path))
    fields = {name: field.contents() for name, field in reader.fields.items() if not name.startswith("GGUF.")}
    return fields, {tensor.name: tensor for tensor in reader.tensors}


def test_gguf_adapter_reads_back_with_names_shapes_alpha_and_values(tiny_adapters, tmp_path):
    path = tmp_path / "lora.gguf"
    result = gguf_export.write_gguf_lora(tiny_adapters["attention"], path, outtype="f32")
    fields, tensors = read_gguf(path)
    assert fields["general.architecture"] == "gpt-oss"
    assert fields["general.type"] == "adapter" and fields["adapter.type"] == "lora"
    assert fields["adapter.lora.alpha"] == 8.0
    expected = {f"blk.{layer}.{proj}.weight.lora_{ab}" for layer in (0, 1) for proj in ATTENTION for ab in "ab"}
    assert set(tensors) == expected == set(result["tensors"])
    peft = load_file(str(tiny_adapters["attention"] / "adapter_model.safetensors"))
    modules = {"attn_q": "q_proj", "attn_k": "k_proj", "attn_v": "v_proj", "attn_output": "o_proj"}
    for name, tensor in tensors.items():
        layer, proj, ab = re.match(r"blk\.(\d)\.(\w+)\.weight\.lora_(a|b)", name).groups()
        source = peft[f"base_model.model.model.layers.{layer}.self_attn.{modules[proj]}.lora_{ab.upper()}.weight"]
        assert tuple(tensor.data.shape) == tuple(source.shape), name  # lora_a [rank, in], lora_b [out, rank]
        assert torch.equal(torch.from_numpy(tensor.data.copy()), source.float()), name
    # llama.cpp's shape rules: a.ne[0] == model in, b.ne[1] == model out, a.ne[1] == b.ne[0] (rank)
    a, b = tensors["blk.0.attn_k.weight.lora_a"], tensors["blk.0.attn_k.weight.lora_b"]
    assert list(a.shape) == [64, 4] and list(b.shape) == [4, 32]


def test_gguf_default_type_is_f16(tiny_adapters, tmp_path):
    from gguf import GGMLQuantizationType

    gguf_export.write_gguf_lora(tiny_adapters["attention"], tmp_path / "lora.gguf")
    _, tensors = read_gguf(tmp_path / "lora.gguf")
    assert {t.tensor_type for t in tensors.values()} == {GGMLQuantizationType.F16}


def test_rslora_scaling_is_folded_into_lora_b(tiny_adapters, tmp_path):
    adapter = tmp_path / "rslora"
    shutil.copytree(tiny_adapters["attention"], adapter)
    config = json.loads((adapter / "adapter_config.json").read_text())
    config["use_rslora"] = True
    (adapter / "adapter_config.json").write_text(json.dumps(config))
    gguf_export.write_gguf_lora(adapter, tmp_path / "lora.gguf", outtype="f32")
    _, tensors = read_gguf(tmp_path / "lora.gguf")
    lora_b = load_file(str(adapter / "adapter_model.safetensors"))[
        "base_model.model.model.layers.0.self_attn.q_proj.lora_B.weight"].float()
    written = torch.from_numpy(tensors["blk.0.attn_q.weight.lora_b"].data.copy())
    # llama.cpp applies alpha / r = 2; PEFT's rsLoRA applies alpha / sqrt(r) = 4
    assert torch.allclose(written * (8 / 4), lora_b * (8 / math.sqrt(4)))


def test_expert_lora_is_refused_or_skipped_out_loud(tiny_adapters, tmp_path, capsys):
    with pytest.raises(gguf_export.GGUFExportError, match="MoE expert weights"):
        gguf_export.write_gguf_lora(tiny_adapters["experts"], tmp_path / "lora.gguf")
    assert not (tmp_path / "lora.gguf").exists()
    result = gguf_export.write_gguf_lora(tiny_adapters["experts"], tmp_path / "lora.gguf", skip_expert_lora=True)
    assert result["skipped"] == ["model.layers.1.mlp.experts"]
    assert "SKIPPING expert LoRA" in capsys.readouterr().out
    _, tensors = read_gguf(tmp_path / "lora.gguf")
    assert len(tensors) == 16 and not any("ffn" in name for name in tensors)


def test_not_an_adapter_folder_is_a_clear_error(tmp_path):
    with pytest.raises(gguf_export.GGUFExportError, match="not a PEFT adapter folder"):
        gguf_export.write_gguf_lora(tmp_path, tmp_path / "lora.gguf")
