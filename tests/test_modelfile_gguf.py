"""The Ollama Modelfile (instructions, paths that exist after an export), the export read the way Ollama's gpt-oss
converter reads it, and the GGUF LoRA adapter (read back)."""

from __future__ import annotations

import json
import math
import re
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file
from test_export import build_tiny_adapter, build_tiny_base, export_settings

import export_gguf_adapter as gguf_export
import export_quantized_model as export

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
    froms = [argument for instruction, argument in entries if instruction == "FROM"]
    assert froms == ["./runs/export/gpt-oss-tes-mxfp4"]
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


@pytest.fixture(scope="module")
def modelfile_exports(tiny_adapters, tmp_path_factory):
    """A copy of the repo's Modelfile with both exports written where it points (relative to the file, as Ollama
    reads it)."""
    root = tmp_path_factory.mktemp("modelfile")
    shutil.copy(REPO / "Modelfile", root / "Modelfile")
    text = (root / "Modelfile").read_text()
    model_dir = root / dict(parse_modelfile(text))["FROM"]
    adapter_file = root / dict(commented_instructions(text))["ADAPTER"]
    assert not model_dir.exists()
    export.run_export(export_settings(tiny_adapters["attention"], model_dir))
    gguf_export.write_gguf_lora(tiny_adapters["attention"], adapter_file)
    return {"model_dir": model_dir, "adapter_file": adapter_file}


@pytest.mark.slow
def test_modelfile_paths_exist_after_an_export(modelfile_exports):
    model_dir, adapter_file = modelfile_exports["model_dir"], modelfile_exports["adapter_file"]
    config = json.loads((model_dir / "config.json").read_text())
    assert config["quantization_config"]["quant_method"] == "mxfp4"
    assert (model_dir / "model.safetensors").is_file() and (model_dir / "tokenizer.json").is_file()
    assert adapter_file.is_file()


# ---------------------------------------------------------------------------------------------------------------
# The export as Ollama's converter reads it (ollama/ollama convert/convert.go, convert_gptoss.go, tokenizer.go)
# ---------------------------------------------------------------------------------------------------------------

# Every config.json key that `ollama create` reads for gpt-oss: (JSON path, Go type of the field it decodes into,
# the value in openai/gpt-oss-20b's config.json; None = absent there, the converter then falls back with cmp.Or).
# A missing key decodes to Go's zero value without an error, which is why each must be checked here.
OLLAMA_CONFIG_KEYS = [
    (("architectures",), "[]string", ["GptOssForCausalLM"]),  # [0] picks the converter (ModelParameters)
    (("model_type",), "string", "gpt_oss"),
    (("vocab_size",), "uint32", 201088),
    (("text_config", "vocab_size"), "uint32", None),  # multimodal models only
    (("num_hidden_layers",), "uint32", 24),  # -> gpt-oss.block_count
    (("max_position_embeddings",), "uint32", 131072),  # -> context_length; > 0 selects the HF tensor names
    (("hidden_size",), "uint32", 2880),  # -> embedding_length
    (("intermediate_size",), "uint32", 2880),  # -> feed_forward_length, expert_feed_forward_length
    (("num_attention_heads",), "uint32", 64),  # -> attention.head_count
    (("num_key_value_heads",), "uint32", 8),  # -> attention.head_count_kv
    (("head_dim",), "uint32", 64),  # -> attention.key_length, value_length
    (("num_experts",), "uint32", None),  # cmp.Or(num_experts, num_local_experts)
    (("num_local_experts",), "uint32", 32),  # -> expert_count
    (("experts_per_token",), "uint32", 4),  # -> expert_used_count (not num_experts_per_tok)
    (("rms_norm_eps",), "float32", 1e-5),  # -> attention.layer_norm_rms_epsilon
    (("initial_context_length",), "uint32", 4096),
    (("rope_theta",), "float32", 150000),  # -> rope.freq_base (transformers 5 keeps it only in rope_parameters)
    (("rope_scaling_factor",), "float32", None),  # OpenAI's original format; cmp.Or with rope_scaling.factor
    (("rope_scaling", "rope_type"), "string", "yarn"),  # -> rope.scaling.type
    (("rope_scaling", "factor"), "float32", 32.0),  # -> rope.scaling.factor
    (("rope_scaling", "original_max_position_embeddings"), "uint32", 4096),  # -> rope.scaling.original_context_length
    (("rope_scaling", "beta_fast"), "float32", 32.0),  # -> rope.scaling.yarn_beta_fast
    (("rope_scaling", "beta_slow"), "float32", 1.0),  # -> rope.scaling.yarn_beta_slow
    (("sliding_window",), "uint32", 128),  # -> attention.sliding_window
]


def go_decode(value, go_type: str, where: str):
    """The value as Go's encoding/json decodes it into a field of go_type; absent or null gives the zero value.

    Raises ValueError where Go's json.Unmarshal fails (`ollama create` then stops), e.g. 4096.0 into a uint32.
    """
    zero = {"uint32": 0, "float32": 0.0, "string": "", "[]string": []}[go_type]
    if value is None:
        return zero
    fits = {"uint32": isinstance(value, int) and not isinstance(value, bool) and 0 <= value < 2**32,
            "float32": isinstance(value, (int, float)) and not isinstance(value, bool),
            "string": isinstance(value, str),
            "[]string": isinstance(value, list) and all(isinstance(v, str) for v in value)}[go_type]
    if not fits:
        raise ValueError(f"{where}: {value!r} does not decode into a Go {go_type}")
    return value


def read_config_like_ollama(folder: Path) -> dict:
    """{JSON path: decoded value} for every key in OLLAMA_CONFIG_KEYS, from folder/config.json."""
    config = json.loads((folder / "config.json").read_text())
    decoded = {}
    for path, go_type, _ in OLLAMA_CONFIG_KEYS:
        value = config
        for part in path:
            value = value.get(part) if isinstance(value, dict) else None
        decoded[path] = go_decode(value, go_type, ".".join(path))
    return decoded


def gguf_kv_like_ollama(keys: dict) -> dict:
    """gptossModel.KV's model keys from decoded config keys (cmp.Or = the first non-zero value)."""
    def first(*values):
        return next((v for v in values if v), values[-1])

    kv = {
        "context_length": first(keys[("max_position_embeddings",)],
                                int(keys[("rope_scaling_factor",)] * keys[("initial_context_length",)])),
        "block_count": keys[("num_hidden_layers",)],
        "embedding_length": keys[("hidden_size",)],
        "feed_forward_length": keys[("intermediate_size",)],
        "expert_feed_forward_length": keys[("intermediate_size",)],
        "expert_count": first(keys[("num_experts",)], keys[("num_local_experts",)]),
        "expert_used_count": keys[("experts_per_token",)],
        "attention.head_count": keys[("num_attention_heads",)],
        "attention.head_count_kv": keys[("num_key_value_heads",)],
        "attention.key_length": keys[("head_dim",)],
        "attention.value_length": keys[("head_dim",)],
        "attention.layer_norm_rms_epsilon": first(keys[("rms_norm_eps",)], 1e-5),
        "attention.sliding_window": keys[("sliding_window",)],
        "rope.freq_base": keys[("rope_theta",)],
        "rope.scaling.type": first(keys[("rope_scaling", "rope_type")], "yarn"),
        "rope.scaling.factor": first(keys[("rope_scaling_factor",)], keys[("rope_scaling", "factor")]),
        "rope.scaling.original_context_length": first(keys[("rope_scaling", "original_max_position_embeddings")],
                                                      keys[("initial_context_length",)]),
    }
    if keys[("rope_scaling", "beta_fast")]:
        kv["rope.scaling.yarn_beta_fast"] = keys[("rope_scaling", "beta_fast")]
    if keys[("rope_scaling", "beta_slow")]:
        kv["rope.scaling.yarn_beta_slow"] = keys[("rope_scaling", "beta_slow")]
    return kv


def chat_template_like_ollama(folder: Path) -> str:
    """tokenizer.chat_template as the converter sets it: only from tokenizer_config.json's chat_template."""
    config = json.loads((folder / "tokenizer_config.json").read_text())
    template = config.get("chat_template", "")
    assert isinstance(template, str), "a list of named templates: Ollama would take the one named default"
    return template


def written_like_the_export_20b(folder: Path) -> Path:
    """openai/gpt-oss-20b's config (gpt_oss_shapes) written as the export writes it (no weights, no tokenizer)."""
    from tes_grpo.experts.mxfp4_checkpoint import write_config_json
    from tes_grpo.model.gpt_oss_shapes import gpt_oss_20b_config

    folder.mkdir(parents=True)
    write_config_json(gpt_oss_20b_config(), folder)
    return folder




# the folder Ollama imports
OLLAMA_FOLDERS = [
    # no weights: the 20B config as the export writes it must read exactly like the real checkpoint
    pytest.param("20b-config", id="20b-config"),
    # the tiny export behind the repo's Modelfile: every key present, none zero
    pytest.param("tiny-export", id="tiny-export", marks=pytest.mark.slow),
    # the tiny checkpoint (tiny_model.py) training starts from
    pytest.param("tiny-checkpoint", id="tiny-checkpoint", marks=pytest.mark.slow),
]


@pytest.fixture
def ollama_folder(request, tmp_path):
    kind = request.param
    if kind == "20b-config":
        return written_like_the_export_20b(tmp_path / "gpt-oss-20b")
    if kind == "tiny-export":
        return request.getfixturevalue("modelfile_exports")["model_dir"]
    from tes_grpo.model.tiny_model import ensure_tiny_checkpoint

    return ensure_tiny_checkpoint()


@pytest.mark.parametrize("ollama_folder", OLLAMA_FOLDERS, indirect=True)
def test_export_reads_in_ollamas_gpt_oss_converter_like_the_real_checkpoint(ollama_folder):
    is_20b = ollama_folder.name == "gpt-oss-20b"
    keys = read_config_like_ollama(ollama_folder)
    config = json.loads((ollama_folder / "config.json").read_text())
    for path, _, real in OLLAMA_CONFIG_KEYS:
        name = ".".join(path)
        if real is None:
            continue  # absent from the real checkpoint too; the converter's fallback covers it
        present = config if len(path) == 1 else config.get(path[0], {})
        assert path[-1] in present, f"config.json lacks {name}, which Ollama's converter reads"
        if is_20b:
            assert keys[path] == pytest.approx(real), name
        else:
            assert keys[path], f"{name} is {keys[path]!r}: Ollama would read zero / empty"
    kv = gguf_kv_like_ollama(keys)
    if is_20b:
        # openai/gpt-oss-20b's values (ollama's convert_gptoss_test.go checks the same mapping)
        assert kv == pytest.approx({
            "context_length": 131072, "block_count": 24, "embedding_length": 2880, "feed_forward_length": 2880,
            "expert_feed_forward_length": 2880, "expert_count": 32, "expert_used_count": 4,
            "attention.head_count": 64, "attention.head_count_kv": 8, "attention.key_length": 64,
            "attention.value_length": 64, "attention.layer_norm_rms_epsilon": 1e-5, "attention.sliding_window": 128,
            "rope.freq_base": 150000, "rope.scaling.type": "yarn", "rope.scaling.factor": 32.0,
            "rope.scaling.original_context_length": 4096, "rope.scaling.yarn_beta_fast": 32.0,
            "rope.scaling.yarn_beta_slow": 1.0})
    else:
        assert all(kv.values()), {k: v for k, v in kv.items() if not v}


@pytest.mark.slow
@pytest.mark.parametrize("ollama_folder", [kind for kind in OLLAMA_FOLDERS if kind.id != "20b-config"],
                         indirect=True)
def test_chat_template_is_where_ollamas_converter_reads_it(ollama_folder):
    # the template Ollama stores, and tests for Harmony (server/routes.go shouldUseHarmony)
    template = chat_template_like_ollama(ollama_folder)
    assert template == (ollama_folder / "chat_template.jinja").read_text()
    assert "<|start|>" in template and "<|end|>" in template


# (config.json value, Go type, decodes) - Go's json.Unmarshal rules the reader above applies
GO_DECODING = [
    (4096, "uint32", 4096),
    (4096.0, "uint32", ValueError),  # a float into an integer field fails the whole `ollama create`
    (None, "uint32", 0),  # absent or null: the zero value, silently
    (150000, "float32", 150000),
    ("yarn", "float32", ValueError),
    (["GptOssForCausalLM"], "[]string", ["GptOssForCausalLM"]),
]


@pytest.mark.parametrize("value, go_type, expected", GO_DECODING)
def test_go_decoding_rules_of_the_reader(value, go_type, expected):
    if expected is ValueError:
        with pytest.raises(ValueError, match="does not decode"):
            go_decode(value, go_type, "key")
    else:
        assert go_decode(value, go_type, "key") == expected


def read_gguf(path: Path):
    from gguf import GGUFReader

    reader = GGUFReader(str(path))
    fields = {name: field.contents() for name, field in reader.fields.items() if not name.startswith("GGUF.")}
    return fields, {tensor.name: tensor for tensor in reader.tensors}


@pytest.mark.slow
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


@pytest.mark.slow
def test_gguf_default_type_is_f16(tiny_adapters, tmp_path):
    from gguf import GGMLQuantizationType

    gguf_export.write_gguf_lora(tiny_adapters["attention"], tmp_path / "lora.gguf")
    _, tensors = read_gguf(tmp_path / "lora.gguf")
    assert {t.tensor_type for t in tensors.values()} == {GGMLQuantizationType.F16}


@pytest.mark.slow
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


@pytest.mark.slow
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
