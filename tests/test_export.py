"""export_quantized_model.py on a tiny gpt-oss: MXFP4 layout, bit-for-bit expert copies, checks, clear errors, and
the Hub upload (HfApi replaced by a fake: no network here) with the token never printed or written."""

from __future__ import annotations

import errno
import importlib
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors import safe_open

import export_quantized_model as export
from tes_grpo.experts import mxfp4_checkpoint
from tes_grpo.experts.mxfp4_checkpoint import SafetensorsCheckpoint, write_mxfp4_checkpoint
from tes_grpo.run.script_config import settings_from

REPO = Path(__file__).resolve().parents[1]
VOCAB = 201088  # the real o200k_harmony vocabulary, so the shared tokenizer works with the tiny model
EXPERT_TARGETS = ["model.layers.0.mlp.experts.gate_up_proj"]
TOKEN = "hf_SECRETtokenNEVERprinted0123456789"  # a fake HF_TOKEN; must appear in no output and no file


def export_settings(adapter, out, **overrides):
    """export_quantized_model's settings as main() resolves them, with these overrides."""
    return settings_from(vars(export), {"ADAPTER_PATH": str(adapter), "OUT_DIR": str(out), "BASE_MODEL_ID": "",
                                        **overrides})


def tiny_config(hidden: int = 64):
    from transformers import GptOssConfig

    # expert dims are multiples of 32 (MXFP4 blocks); 131072 positions keep YaRN's factor 32 consistent
    return GptOssConfig(
        hidden_size=hidden, intermediate_size=64, num_hidden_layers=2, num_local_experts=4, num_experts_per_tok=2,
        num_attention_heads=4, num_key_value_heads=2, head_dim=16, vocab_size=VOCAB,
        layer_types=["sliding_attention", "full_attention"], sliding_window=16, max_position_embeddings=131072,
        pad_token_id=199999, eos_token_id=200002, bos_token_id=199998,
    )


def build_tiny_base(folder: Path, hidden: int = 64, seed: int = 0) -> Path:
    """A random tiny gpt-oss written in openai/gpt-oss's MXFP4 checkpoint layout."""
    from transformers import GptOssForCausalLM

    torch.manual_seed(seed)
    model = GptOssForCausalLM(tiny_config(hidden)).to(torch.bfloat16)
    write_mxfp4_checkpoint(model, model.config, folder)
    return folder


def build_tiny_adapter(base: Path, folder: Path, expert_targets=(), seed: int = 1) -> Path:
    """A LoRA adapter on the attention projections (+ `expert_targets` via target_parameters), made non-zero."""
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM, Mxfp4Config

    model = AutoModelForCausalLM.from_pretrained(base, quantization_config=Mxfp4Config(dequantize=True),
                                                 dtype=torch.bfloat16)
    config = LoraConfig(r=4, lora_alpha=8, lora_dropout=0.0, target_modules="all-linear",
                        target_parameters=list(expert_targets) or None)
    peft_model = get_peft_model(model, config)
    torch.manual_seed(seed)
    with torch.no_grad():
        for name, param in peft_model.named_parameters():
            if "lora_B" in name:  # PEFT starts lora_B at zero; a trained adapter is not
                param.normal_(0, 0.5)
    peft_model.save_pretrained(folder)
    return folder


@pytest.fixture(scope="module")
def tiny_export(tmp_path_factory):
    root = tmp_path_factory.mktemp("export")
    base = build_tiny_base(root / "base")
    adapter = build_tiny_adapter(base, root / "adapter", EXPERT_TARGETS)
    out = root / "out" / "gpt-oss-tes-mxfp4"
    summary = export.run_export(export_settings(adapter, out, CHECK=True))
    return {"root": root, "base": base, "adapter": adapter, "out": out, "summary": summary}


@pytest.mark.slow
def test_export_is_an_mxfp4_checkpoint_with_tokenizer_and_generation_config(tiny_export):
    out = tiny_export["out"]
    config = json.loads((out / "config.json").read_text())
    assert config["quantization_config"]["quant_method"] == "mxfp4"
    assert config["use_cache"] is True
    with safe_open(str(out / "model.safetensors"), framework="pt") as handle:
        names = set(handle.keys())
        blocks = handle.get_tensor("model.layers.0.mlp.experts.gate_up_proj_blocks")
        q_proj = handle.get_tensor("model.layers.0.self_attn.q_proj.weight")
    assert blocks.dtype == torch.uint8 and blocks.shape == (4, 128, 2, 16)
    assert q_proj.dtype == torch.bfloat16
    assert not any(name.endswith(("experts.gate_up_proj", "experts.down_proj")) for name in names)
    assert not any("lora" in name for name in names)
    generation = json.loads((out / "generation_config.json").read_text())
    assert generation["eos_token_id"] == [200002, 200012]
    assert (out / "tokenizer.json").is_file() and (out / "chat_template.jinja").is_file()
    assert not list(out.parent.glob(".*tmp-*"))  # the temporary folder was renamed, not left behind


@pytest.mark.slow
def test_untouched_experts_are_copied_bit_for_bit_and_adapted_ones_requantized(tiny_export):
    base, out = SafetensorsCheckpoint(tiny_export["base"]), SafetensorsCheckpoint(tiny_export["out"])
    summary = tiny_export["summary"]
    assert summary["copied"] == 3 and summary["quantized"] == 1
    for name in ("model.layers.0.mlp.experts.down_proj", "model.layers.1.mlp.experts.gate_up_proj",
                 "model.layers.1.mlp.experts.down_proj"):
        for part in ("blocks", "scales"):
            assert torch.equal(out[f"{name}_{part}"], base[f"{name}_{part}"]), name
    adapted = "model.layers.0.mlp.experts.gate_up_proj_blocks"
    assert not torch.equal(out[adapted], base[adapted])
    # attention LoRA merged: q_proj moved away from the base
    q_name = "model.layers.0.self_attn.q_proj.weight"
    assert not torch.equal(out[q_name], base[q_name])


@pytest.mark.slow
def test_check_reports_fp4_rounding_logits_and_the_cpu_fallback(tiny_export):
    check = tiny_export["summary"]["check"]
    # weights: compare_weights ran without assertion; the adapted expert moved by FP4 rounding, not more
    assert 0 < check["max_expert_rounding_error"] < 1.0
    # the export computes exactly what the merged model computes once its experts are FP4-rounded
    assert check["logit_diff_vs_merged_with_fp4_experts"] <= 1e-6 * check["logit_scale"]
    assert check["logit_diff_vs_merged"] > 0  # the adapted expert really was rounded
    assert check["load_without_dequantize"].startswith("FELL BACK")  # this CPU machine has no triton kernels
    assert "what works without it: the export itself" in check["load_without_dequantize"]
    assert check["load_without_dequantize_weights"] == "equal to the dequantized load"


@pytest.fixture(scope="module")
def attention_export(tiny_export):
    """Export of an attention-only adapter (the default training recipe) on the same tiny base."""
    root = tiny_export["root"]
    adapter = build_tiny_adapter(tiny_export["base"], root / "attention_adapter", seed=2)
    out = root / "out" / "attention-only"
    return {"out": out, "summary": export.run_export(export_settings(adapter, out, CHECK=True))}


@pytest.mark.slow
def test_attention_only_adapter_exports_every_expert_unchanged_and_logits_exactly(attention_export):
    summary = attention_export["summary"]
    assert summary["copied"] == 4 and summary["quantized"] == 0
    assert summary["check"]["max_expert_rounding_error"] == 0.0
    assert summary["check"]["logit_diff_vs_merged"] == 0.0


@pytest.mark.slow
def test_run_exported_model_generates_and_parses(attention_export, tmp_path, capsys):
    import pandas as pd

    import run_exported_model as run
    from tes_grpo.task.harmony import load_tokenizer

    tokenizer = load_tokenizer()
    prompts = [tokenizer.apply_chat_template([{"role": "user", "content": f"Hour {h}: answer [k] with k in 0..3."}],
                                             tokenize=False, add_generation_prompt=True) for h in range(3)]
    csv = tmp_path / "w1_q_dataset_harmony.csv"
    pd.DataFrame({"prompt": prompts, "optimal_action": [0, 1, 2]}).to_csv(csv, index=False)
    frame = run.load_prompts(tmp_path, max_rows=2)
    assert list(frame["row"]) == [1, 2]  # data rows, 1 = the first after the header, as every input error counts
    model, tok, path = run.load_model(str(attention_export["out"]), dequantize=False, device="cpu")
    assert path.startswith("resident MXFP4")  # the training loader's: experts kept as MXFP4, on any machine
    texts = run.generate_completions(model, tok, list(frame["prompt"]), max_new_tokens=4, do_sample=True,
                                     temperature=1.0, top_p=1.0, seed=0)
    assert len(texts) == 2 and all(isinstance(t, str) and t for t in texts)
    result = run.decisions(frame, texts)
    # a random tiny model cut at 4 tokens never closes a final message: invalid, not a guessed action
    assert result["action"].isna().all()
    run.print_decisions(result)
    printed = capsys.readouterr().out
    assert "w1_q_dataset_harmony.csv row 1: action invalid, optimal [0]" in printed and "0/2 valid answers" in printed


@pytest.mark.parametrize("text, expected", [
    # analysis then final, closed by <|return|>
    ("<|channel|>analysis<|message|>think<|end|><|start|>assistant<|channel|>final<|message|>[2]<|return|>", "[2]"),
    # two final messages: the last one counts, as in harmony.parse_action
    ("<|channel|>final<|message|>[1]<|end|><|start|>assistant<|channel|>final<|message|>[0] ok<|return|>", "[0] ok"),
    # no final channel at all
    ("<|channel|>analysis<|message|>still thinking", None),
    # truncated final message: the text so far
    ("<|channel|>final<|message|>[3", "[3"),
])
def test_final_answer(text, expected):
    import run_exported_model as run

    assert run.final_answer(text) == expected


def test_load_prompts_rejects_legacy_prompts(tmp_path):
    import pandas as pd

    import run_exported_model as run
    from tes_grpo.run.fileio import InputError

    csv = tmp_path / "x_harmony.csv"
    pd.DataFrame({"prompt": ["system: be an operator\nuser: hour 1"]}).to_csv(csv, index=False)
    with pytest.raises(InputError, match=r"x_harmony.csv, row 1, column 'prompt'"):
        run.load_prompts(csv, max_rows=0)


@pytest.mark.slow
def test_compare_weights_rejects_a_weight_beyond_fp4_rounding(tiny_export):
    from transformers import AutoModelForCausalLM, Mxfp4Config

    out = tiny_export["out"]
    loaded = AutoModelForCausalLM.from_pretrained(out, quantization_config=Mxfp4Config(dequantize=True),
                                                  dtype=torch.bfloat16).state_dict()
    merged = {name: tensor.clone() for name, tensor in loaded.items()}
    export.compare_weights(loaded, merged, SafetensorsCheckpoint(out), set(EXPERT_TARGETS))
    merged["model.layers.0.mlp.experts.gate_up_proj"][0, 0, 0] += 10.0
    with pytest.raises(AssertionError, match="beyond FP4 rounding"):
        export.compare_weights(loaded, merged, SafetensorsCheckpoint(out), set(EXPERT_TARGETS))


def test_missing_adapter_is_a_clear_error(tmp_path):
    with pytest.raises(export.ExportError, match="does not exist"):
        export.run_export(export_settings(tmp_path / "nope", tmp_path / "out"))
    (tmp_path / "empty").mkdir()
    with pytest.raises(export.ExportError, match="no adapter_config.json"):
        export.run_export(export_settings(tmp_path / "empty", tmp_path / "out"))


@pytest.mark.slow
def test_adapter_for_another_base_is_refused(tiny_export, tmp_path):
    other = build_tiny_base(tmp_path / "other", hidden=96)
    # named mismatch: the adapter records tiny_export's base
    with pytest.raises(export.ExportError, match="was trained on"):
        export.run_export(export_settings(tiny_export["adapter"], tmp_path / "out", BASE_MODEL_ID=str(other)))
    # same name allowed, but the shapes give it away
    with pytest.raises(export.ExportError, match="made for another base"):
        export.run_export(export_settings(tiny_export["adapter"], tmp_path / "out", BASE_MODEL_ID=str(other),
                                          ALLOW_OTHER_BASE=True))
    assert not (tmp_path / "out").exists()


@pytest.mark.slow
def test_too_little_disk_space_fails_before_loading(tiny_export, tmp_path, monkeypatch):
    class Usage:
        free = 1000

    monkeypatch.setattr(export.shutil, "disk_usage", lambda path: Usage)
    with pytest.raises(export.ExportError, match="not enough disk space"):
        export.run_export(export_settings(tiny_export["adapter"], tmp_path / "out"))
    assert not (tmp_path / "out").exists()


@pytest.mark.slow
def test_disk_full_while_writing_keeps_the_old_export(tiny_export, tmp_path, monkeypatch):
    out = tmp_path / "out"
    out.mkdir()
    (out / "keep.txt").write_text("previous export")

    def write_until_disk_full(state_dict, config, folder, **kwargs):
        (Path(folder) / "model.safetensors").write_bytes(b"partial")
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(mxfp4_checkpoint, "write_mxfp4_checkpoint", write_until_disk_full)
    with pytest.raises(export.ExportError, match="disk full"):
        export.run_export(export_settings(tiny_export["adapter"], out, OVERWRITE=True))
    assert (out / "keep.txt").read_text() == "previous export"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["out"]  # no temporary folder left


@pytest.mark.slow
def test_existing_output_needs_overwrite(tiny_export):
    with pytest.raises(export.ExportError, match="OVERWRITE"):
        export.run_export(export_settings(tiny_export["adapter"], tiny_export["out"]))


def run_script(tmp_path, env: dict) -> subprocess.CompletedProcess:
    """export_quantized_model.py as a user runs it, with a missing adapter, HF_* taken only from `env`."""
    base_env = {k: v for k, v in os.environ.items() if not k.startswith("HF_")}
    return subprocess.run([sys.executable, "export_quantized_model.py", f"--ADAPTER_PATH={tmp_path / 'missing'}",
                           f"--OUT_DIR={tmp_path / 'out'}"], cwd=REPO, capture_output=True, text=True,
                          env={**base_env, **env}, timeout=120)


def test_command_line_error_exits_1_without_traceback(tmp_path):
    result = run_script(tmp_path, {"HF_TOKEN": TOKEN})
    assert result.returncode == 1
    assert result.stderr.startswith("error: ") and "adapter folder does not exist" in result.stderr
    assert "Traceback" not in result.stderr
    assert TOKEN not in result.stdout + result.stderr


def test_unreachable_or_rejecting_hub_is_one_error_line_before_the_export(tmp_path):
    # the real HfApi: with no network (this machine) whoami fails to connect; with network the fake token gets a 401
    result = run_script(tmp_path, {"HF_TOKEN": TOKEN, "HF_REPO_ID": "someone/gpt-oss-tes"})
    assert result.returncode == 1, result.stderr
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: checking HF_TOKEN: "), result.stderr
    assert "nothing was exported" in lines[0]
    assert TOKEN not in result.stdout + result.stderr
    assert not (tmp_path / "out").exists()


# ---------------------------------------------------------------------------------------------------------------
# Hub upload with huggingface_hub.HfApi replaced by FakeHub
# ---------------------------------------------------------------------------------------------------------------

def http_module():
    """The HTTP client huggingface_hub raises with (httpx under huggingface_hub 1.x, httpx2 under 2.x)."""
    from huggingface_hub import errors

    return importlib.import_module(errors.HTTPError.__module__.split(".")[0])


def hub_http_error(status: int, error_class=None):
    from huggingface_hub.errors import HfHubHTTPError

    http = http_module()
    response = http.Response(status, request=http.Request("GET", "https://huggingface.co/api/x"))
    return (error_class or HfHubHTTPError)(f"{status} Client Error for url: https://huggingface.co/api/x",
                                           response=response)


def connect_error():
    return http_module().ConnectError("[Errno -2] Name or service not known")


class FakeHub:
    """Stands in for huggingface_hub.HfApi: records calls; `state` says what the Hub holds and how it fails."""

    calls: list = []
    state: dict = {}

    def __init__(self, token=None):
        FakeHub.calls.append(("init", token))

    def _fail(self, name):
        failure = FakeHub.state.get("fail", {}).get(name)
        if failure is not None:
            raise failure()

    def whoami(self):
        FakeHub.calls.append(("whoami",))
        self._fail("whoami")
        return {"name": "me", "orgs": [{"name": "my-org"}],
                "auth": {"accessToken": {"role": FakeHub.state.get("role", "write")}}}

    def repo_info(self, repo_id, repo_type=None):
        from huggingface_hub.errors import RepositoryNotFoundError

        FakeHub.calls.append(("repo_info", repo_id))
        self._fail("repo_info")
        visibility = FakeHub.state.get("repo")
        if visibility is None:
            raise hub_http_error(404, RepositoryNotFoundError)

        class Info:
            private = visibility == "private"
        return Info

    def create_repo(self, repo_id, private=None, exist_ok=False, repo_type=None):
        FakeHub.calls.append(("create_repo", repo_id, private, exist_ok))
        self._fail("create_repo")
        FakeHub.state.setdefault("repo", FakeHub.state.get("created_as", "private" if private else "public"))
        return f"https://huggingface.co/{repo_id}"

    def upload_folder(self, folder_path, repo_id, repo_type=None, commit_message=None):
        FakeHub.calls.append(("upload_folder", repo_id))
        self._fail("upload_folder")
        FakeHub.state["uploaded"] = sorted(p.name for p in Path(folder_path).iterdir())


@pytest.fixture
def fake_hub(monkeypatch):
    import huggingface_hub

    FakeHub.calls, FakeHub.state = [], {}
    monkeypatch.setattr(huggingface_hub, "HfApi", FakeHub)
    return FakeHub


def run_main(tmp_path, capsys, adapter, environ: dict, *argv: str) -> tuple[int, str, str]:
    code = export.main([f"--ADAPTER_PATH={adapter}", f"--OUT_DIR={tmp_path / 'out'}", *argv], environ)
    captured = capsys.readouterr()
    return code, captured.out, captured.err


# (environment, extra settings, what the Hub does, start of the one error line); all before anything is exported
REFUSED_BEFORE_EXPORT = [
    # a repo id but no token
    ({"HF_REPO_ID": "me/tes"}, [], {}, "error: HF_REPO_ID=me/tes asks for an upload, but HF_TOKEN is not set"),
    # not owner/name
    ({"HF_TOKEN": TOKEN, "HF_REPO_ID": "tes"}, [], {}, "error: HF_REPO_ID='tes' is not a Hub repo id of the form"),
    ({"HF_TOKEN": TOKEN, "HF_REPO_ID": "me/tes/x"}, [], {}, "error: HF_REPO_ID='me/tes/x' is not a Hub repo id"),
    # the setting wins over the environment; "--" is not allowed in a repo name
    ({"HF_TOKEN": TOKEN, "HF_REPO_ID": "me/tes"}, ["--HUB_REPO_ID=me/bad--name"], {},
     "error: --HUB_REPO_ID='me/bad--name' is not a valid Hub repo id"),
    # the Hub rejects the token
    ({"HF_TOKEN": TOKEN, "HF_REPO_ID": "me/tes"}, [], {"fail": {"whoami": lambda: hub_http_error(401)}},
     "error: checking HF_TOKEN: the Hub answered 401"),
    # no network
    ({"HF_TOKEN": TOKEN, "HF_REPO_ID": "me/tes"}, [], {"fail": {"whoami": connect_error}},
     "error: checking HF_TOKEN: cannot reach the Hugging Face Hub (ConnectError"),
    # a read token cannot upload
    ({"HF_TOKEN": TOKEN, "HF_REPO_ID": "me/tes"}, [], {"role": "read"},
     "error: HF_TOKEN belongs to me but is a read-only"),
    # somebody else's namespace
    ({"HF_TOKEN": TOKEN, "HF_REPO_ID": "openai/tes"}, [], {},
     "error: HF_TOKEN belongs to me, which cannot write to openai/"),
    # an existing public repo, without --ALLOW_PUBLIC_REPO
    ({"HF_TOKEN": TOKEN, "HF_REPO_ID": "my-org/tes"}, [], {"repo": "public"}, "error: my-org/tes exists and is PUBLIC"),
]


@pytest.mark.parametrize("environ, argv, hub, error", REFUSED_BEFORE_EXPORT)
def test_hub_problems_stop_before_the_export(tmp_path, capsys, fake_hub, environ, argv, hub, error):
    fake_hub.state.update(hub)
    # a missing adapter would be the next error: seeing the Hub's proves nothing else ran first
    code, out, err = run_main(tmp_path, capsys, tmp_path / "missing", environ, *argv)
    assert code == 1
    assert err.startswith(error) and err.count("\n") == 1 and "; nothing was exported" in err, err
    assert "Traceback" not in err and TOKEN not in out + err
    assert not (tmp_path / "out").exists()
    assert not any(call[0] in ("create_repo", "upload_folder") for call in fake_hub.calls)


def files_containing(folder: Path, text: str) -> list[str]:
    return [str(p) for p in folder.rglob("*") if p.is_file() and text.encode() in p.read_bytes()]


# (environment, extra settings, the Hub before, repo uploaded to, its visibility after, last line printed)
UPLOADS = [
    # a new repo: created private
    ({"HF_TOKEN": TOKEN, "HF_REPO_ID": "me/tes"}, [], {}, "me/tes", "private",
     "uploaded to https://huggingface.co/me/tes (private)"),
    # an existing private repo of an organisation the token belongs to
    ({"HF_TOKEN": TOKEN, "HF_REPO_ID": "my-org/tes"}, [], {"repo": "private"}, "my-org/tes", "private",
     "uploaded to https://huggingface.co/my-org/tes (private)"),
    # an existing public repo, explicitly allowed: said as public
    ({"HF_TOKEN": TOKEN, "HF_REPO_ID": "me/tes"}, ["--ALLOW_PUBLIC_REPO=1"], {"repo": "public"}, "me/tes", "public",
     "uploaded to https://huggingface.co/me/tes (public)"),
    # the setting instead of the environment
    ({"HF_TOKEN": TOKEN}, ["--HUB_REPO_ID=me/other"], {}, "me/other", "private",
     "uploaded to https://huggingface.co/me/other (private)"),
    # no repo id: no upload, said so, the token never used
    ({"HF_TOKEN": TOKEN}, [], {}, None, None, "not pushed to the Hub: no HF_REPO_ID / --HUB_REPO_ID given"),
    # uploads switched off
    ({"HF_TOKEN": TOKEN, "HF_REPO_ID": "me/tes"}, ["--PUSH_TO_HUB=0"], {}, None, None,
     "not pushed to the Hub: --PUSH_TO_HUB=0"),
]


@pytest.mark.slow
@pytest.mark.parametrize("environ, argv, hub, repo_id, visibility, last_line", UPLOADS)
def test_upload_after_the_export_never_shows_the_token(tiny_export, tmp_path, capsys, fake_hub, environ, argv, hub,
                                                       repo_id, visibility, last_line):
    fake_hub.state.update(hub)
    code, out, err = run_main(tmp_path, capsys, tiny_export["adapter"], environ, *argv)
    assert code == 0, err
    assert out.strip().splitlines()[-1] == last_line
    assert TOKEN not in out + err and files_containing(tmp_path, TOKEN) == []
    assert (tmp_path / "out" / "config.json").is_file()
    if repo_id is None:
        assert fake_hub.calls == []  # HfApi never even built
        return
    assert fake_hub.calls[0] == ("init", TOKEN)  # the token goes to the client, nowhere else
    assert ("create_repo", repo_id, True, True) in fake_hub.calls  # always asked for private
    assert fake_hub.state["repo"] == visibility
    assert "export_config.json" in fake_hub.state["uploaded"] and "config.json" in fake_hub.state["uploaded"]


# (what the Hub does after the export, start of the one error line)
FAILED_UPLOADS = [
    # someone made a public repo of that name during the export: create_repo(exist_ok=True) leaves it public
    ({"created_as": "public"}, "error: me/tes is PUBLIC, not private: not uploading"),
    # the network went away during the export
    ({"fail": {"upload_folder": connect_error}}, "error: uploading to me/tes: cannot reach the Hugging Face Hub"),
    # the Hub refused the upload
    ({"fail": {"create_repo": lambda: hub_http_error(403)}}, "error: creating me/tes: the Hub answered 403"),
]


@pytest.mark.slow
@pytest.mark.parametrize("hub, error", FAILED_UPLOADS)
def test_failed_upload_is_one_error_line_and_keeps_the_export(tiny_export, tmp_path, capsys, fake_hub, hub, error):
    fake_hub.state.update(hub)
    code, out, err = run_main(tmp_path, capsys, tiny_export["adapter"], {"HF_TOKEN": TOKEN, "HF_REPO_ID": "me/tes"})
    assert code == 1
    last = err.strip().splitlines()[-1]  # above it only transformers' loading progress bars
    assert last.startswith(error) and err.count("error:") == 1 and "Traceback" not in err, err
    assert f"upload it later with `hf upload me/tes {tmp_path / 'out'}`" in err
    assert TOKEN not in out + err and files_containing(tmp_path, TOKEN) == []
    assert (tmp_path / "out" / "model.safetensors").is_file()
    assert "uploaded" not in fake_hub.state
