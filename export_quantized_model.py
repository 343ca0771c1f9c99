"""Merge a GRPO LoRA adapter into gpt-oss and write a real MXFP4 checkpoint (OpenAI's layout), ready to serve.

    python export_quantized_model.py --ADAPTER_PATH=runs/grpo-gpt-oss-20b --OUT_DIR=runs/export/gpt-oss-tes-mxfp4
    python export_quantized_model.py --ADAPTER_PATH=runs/grpo-gpt-oss-20b/best   # the checkpoint that evaluated best
    python export_quantized_model.py --CHECK            # also reload the export and compare weights and logits
    export HF_TOKEN=hf_...; export HF_REPO_ID=you/gpt-oss-20b-tes; python export_quantized_model.py   # + private upload

Loads the base with `Mxfp4Config(dequantize=True)` (bf16), applies the adapter with PEFT,
`merge_and_unload()`s it, and writes the MoE experts as `*_blocks` / `*_scales` (uint8) and everything
else bf16, with `quantization_config: {quant_method: mxfp4, ...}`: about 13 GB for gpt-oss-20b, not 42.
Expert weights the adapter did not touch (all of them unless training used `target_parameters`) are
copied bit for bit from the base checkpoint's blocks and scales, not re-quantized. The tokenizer, chat
template (also inside tokenizer_config.json, where Ollama reads it) and a generation config ending on
`<|return|>` / `<|call|>` go with it; config.json also carries the original checkpoint's `rope_theta`,
`rope_scaling` and `experts_per_token`, which Ollama's converter reads. The folder is written under a temporary
name and renamed when complete, so a failed export never leaves a half-written model.

Upload (tes_grpo/run/hub_upload.py): with a repo id (HF_REPO_ID in the environment, or --HUB_REPO_ID) the folder
goes to that Hub repo, created private. The token (HF_TOKEN), the repo id's form, the token's validity and the
repo's visibility are checked before the slow export; an existing public repo is refused unless
--ALLOW_PUBLIC_REPO=1. The token is never printed.
"""

from __future__ import annotations

import errno
import json
import os
import shutil
import sys
import typing
from pathlib import Path

from tes_grpo.run import (  # the module: its UPPER_CASE names imported here would become settings
    adapter_folder,
    run_folder,
)
from tes_grpo.run.fileio import InputError, give_default_modes, replace_folder, temporary_folder
from tes_grpo.run.hub_upload import HubError, check_hub_access, hub_target, push_folder_to_hub, redact
from tes_grpo.run.sources import SourceError, check_model_id

if typing.TYPE_CHECKING:  # annotations only; the module is imported where it is used
    from tes_grpo.experts.mxfp4_checkpoint import SafetensorsCheckpoint

ADAPTER_PATH = "runs/grpo-gpt-oss-20b"  # PEFT LoRA folder (adapter_config.json + safetensors); <run>/best: its best
BASE_MODEL_ID = ""  # base checkpoint (hub id or folder); "" = the adapter's base_model_name_or_path
ALLOW_OTHER_BASE = False  # merge even when BASE_MODEL_ID differs from the base the adapter names (shapes still checked)
OUT_DIR = "runs/export/gpt-oss-tes-mxfp4"  # export folder (the Modelfile's FROM points here)
OVERWRITE = False  # replace an existing OUT_DIR (the old one stays until the new one is complete)
MAX_SHARD_GB = 5.0  # safetensors shard size in GB, as in the hub checkpoints
DISK_MARGIN_GB = 1.0  # free space required on top of the estimated export size, GB
CHECK = False  # after writing, reload the export and compare weights and logits with the merged model
LOGIT_RTOL = 1e-3  # --CHECK: largest logit difference to the FP4-rounded merged model, relative to the largest logit
CHECK_TEXT = "The storage tank is charged at night when the grid is cleanest."  # text whose logits --CHECK compares
PUSH_TO_HUB = True  # upload OUT_DIR when a repo id is given (HF_REPO_ID or --HUB_REPO_ID); 0 = never upload
HUB_REPO_ID = ""  # Hub repo "owner/name" for the upload; "" = the HF_REPO_ID environment variable (neither: no upload)
ALLOW_PUBLIC_REPO = False  # upload into an existing PUBLIC repo (new repos are always created private)
_TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json")
# --CHECK, where transformers' native MXFP4 path (its kernels) cannot run here: the export does not depend on it
_WITHOUT_NATIVE_MXFP4 = ("what works without it: the export itself (checked above through the dequantizing load, "
                         "Mxfp4Config(dequantize=True)), run_exported_model.py (experts kept resident as MXFP4 on any "
                         "device), and the folder as it is for vLLM and Ollama")


class ExportError(RuntimeError):
    """A problem with the export's inputs or destination, explained for the user."""


class CheckFailed(AssertionError):
    """--CHECK found the export's weights or logits off; the message names the tensor."""


def same_base(name_a: str | None, name_b: str | None) -> bool:
    """Whether two base ids name the same model: equal hub ids, or folders that resolve to the same path."""
    if not name_a or not name_b:
        return True  # an adapter saved from an in-memory model records no name; shapes decide
    if name_a.rstrip("/") == name_b.rstrip("/"):
        return True
    path_a, path_b = Path(name_a), Path(name_b)
    return path_a.exists() and path_b.exists() and path_a.resolve() == path_b.resolve()


def resolve_base_folder(base_id: str) -> Path:
    """Local folder of the base checkpoint: the folder itself, or the hub snapshot (downloaded once, cached)."""
    if Path(base_id).is_dir():
        return Path(base_id)
    from huggingface_hub import snapshot_download

    print(f"base {base_id} is not a local folder: fetching its config and safetensors from the hub (cached)")
    return Path(snapshot_download(base_id, allow_patterns=["*.json", "*.safetensors", "*.jinja", "*.tiktoken"]))


def adapter_tensor_shapes(adapter_path: Path) -> dict[str, tuple[int, ...]]:
    from safetensors import safe_open

    weights = adapter_path / run_folder.ADAPTER_WEIGHTS
    if not weights.is_file():
        return {}
    with safe_open(str(weights), framework="pt") as handle:
        return {name: tuple(handle.get_slice(name).get_shape()) for name in handle.keys()}


def adapter_module_path(key: str) -> tuple[str, str] | None:
    """`base_model.model.X(.base_layer)*.lora_A.weight` -> ("X", "lora_A"); None for other keys."""
    for part in ("lora_A", "lora_B"):
        suffix = f".{part}.weight"
        if key.endswith(suffix):
            module = key[: -len(suffix)].removeprefix("base_model.model.")
            return module.replace(".base_layer", ""), part
    return None


def check_adapter_fits_base(adapter_path: Path, base_folder: Path) -> None:
    """Compares every LoRA factor's shape with the base's module (built on the meta device, no weights)."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.from_pretrained(base_folder)
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config)
    modules = dict(model.named_modules())
    problems = []
    for key, shape in adapter_tensor_shapes(adapter_path).items():
        found = adapter_module_path(key)
        if found is None:
            continue
        module_name, part = found
        module = modules.get(module_name)
        if module is None:
            problems.append(f"{key}: the base has no module {module_name}")
        elif isinstance(module, torch.nn.Linear):
            # lora_A is [rank, in_features], lora_B is [out_features, rank]
            fits = shape[1] == module.in_features if part == "lora_A" else shape[0] == module.out_features
            if not fits:
                problems.append(f"{key}: shape {shape} does not fit {module_name} "
                                f"(in {module.in_features}, out {module.out_features})")
        else:
            # target_parameters on 3-D experts: lora_A [rank*E, in], lora_B [out, rank*E]
            dims = {d for p in module.parameters(recurse=False) if p.dim() == 3 for d in p.shape[1:]}
            feature_dim = shape[1] if part == "lora_A" else shape[0]
            if dims and feature_dim not in dims:
                problems.append(f"{key}: shape {shape} fits none of {module_name}'s expert parameters")
    if problems:
        more = f"\n  ... {len(problems) - 10} more" if len(problems) > 10 else ""
        raise ExportError(f"adapter {adapter_path} was made for another base than {base_folder}:\n  "
                          + "\n  ".join(problems[:10]) + more)


def checkpoint_bytes(folder: Path) -> int:
    return sum(path.stat().st_size for path in folder.glob("*.safetensors"))


def check_free_space(out_dir: Path, needed_bytes: int) -> None:
    """ExportError unless the filesystem holding `out_dir` has `needed_bytes` free."""
    probe = out_dir.parent
    while not probe.exists():
        probe = probe.parent
    free = shutil.disk_usage(probe).free
    if free < needed_bytes:
        raise ExportError(f"not enough disk space for the export: about {needed_bytes / 1e9:.2f} GB needed, "
                          f"{free / 1e9:.2f} GB free on the filesystem of {probe}. Free space or set --OUT_DIR "
                          f"elsewhere.")


def load_merged_model(base_folder: Path, adapter_path: Path):
    """(merged bf16 model, set of expert parameter names the adapter changed)."""
    import torch
    from peft import PeftModel
    from peft.tuners.lora.layer import ParamWrapper
    from transformers import AutoModelForCausalLM, Mxfp4Config

    from tes_grpo.model.model_loading import checkpoint_is_mxfp4
    from tes_grpo.patches import transformers_patches

    kwargs = {"quantization_config": Mxfp4Config(dequantize=True)} if checkpoint_is_mxfp4(base_folder) else {}
    # transformers' dequantizing warnings (the check's FELL BACK line says why), PEFT's read of a deprecated property
    transformers_patches.quiet_mxfp4_fallback_warnings()
    transformers_patches.quiet_gradient_checkpointing_deprecation()
    base = AutoModelForCausalLM.from_pretrained(base_folder, dtype=torch.bfloat16, **kwargs)
    peft_model = PeftModel.from_pretrained(base, str(adapter_path))
    touched = set()
    for name, module in peft_model.named_modules():
        if isinstance(module, ParamWrapper):
            owner = name.removeprefix("base_model.model.").replace(".base_layer", "")
            touched.add(f"{owner}.{module.parameter_name}")
    merged = peft_model.merge_and_unload()
    merged.eval()
    return merged, touched


def base_expert_passthrough(base_folder: Path, state_dict: dict, touched: set[str]):
    """Lazy view of the base's `*_blocks` / `*_scales` for every expert parameter the adapter left alone."""
    from tes_grpo.experts.mxfp4_checkpoint import EXPERT_PARAM_RE, SafetensorsCheckpoint
    from tes_grpo.model.model_loading import checkpoint_is_mxfp4

    if not checkpoint_is_mxfp4(base_folder):
        print(f"base {base_folder} is not an MXFP4 checkpoint: every expert is quantized from its bf16 weights")
        return {}
    wanted = {f"{name}_{part}" for name in state_dict if EXPERT_PARAM_RE.match(name) and name not in touched
              for part in ("blocks", "scales")}
    return SafetensorsCheckpoint(base_folder, only=wanted)


def export_tokenizer_source(adapter_path: Path, base_folder: Path) -> str:
    """Where the export's tokenizer comes from: the adapter's folder (train_grpo.py saves it there), else the base's,
    else the project's gpt-oss tokenizer, checked (an ExportError naming GPT_OSS_TOKENIZER when there is none)."""
    from tes_grpo.task.harmony import check_tokenizer_source

    for folder in (adapter_path, base_folder):
        if all((folder / name).is_file() for name in _TOKENIZER_FILES):
            return str(folder)
    try:
        return check_tokenizer_source()
    except SourceError as err:
        raise ExportError(str(err)) from None


def load_export_tokenizer(adapter_path: Path, base_folder: Path):
    """(tokenizer, where it came from: export_tokenizer_source)."""
    from transformers import AutoTokenizer

    source = export_tokenizer_source(adapter_path, base_folder)
    return AutoTokenizer.from_pretrained(source), source


def export_generation_config(base_folder: Path, tokenizer):
    """Base generation config (if any) with gpt-oss's end tokens and recommended sampling (T=1, top_p=1)."""
    from transformers import GenerationConfig

    from tes_grpo.task.harmony import ANSWER_END_IDS, BOS_ID, PAD_ID, check_token_ids

    try:
        check_token_ids(tokenizer)
    except ValueError as err:
        raise ExportError(str(err)) from None
    if (base_folder / "generation_config.json").is_file():
        generation = GenerationConfig.from_pretrained(base_folder)
    else:
        generation = GenerationConfig()
    generation.eos_token_id = list(ANSWER_END_IDS)  # a served model stops at a final answer or a tool call
    generation.bos_token_id = BOS_ID
    generation.pad_token_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else PAD_ID
    generation.do_sample, generation.temperature, generation.top_p = True, 1.0, 1.0
    return generation


def write_export(merged, touched: set[str], base_folder: Path, adapter_path: Path, out_dir: Path,
                 overwrite: bool = False, max_shard_bytes: int | None = None, disk_margin_bytes: int = 0,
                 settings_record: dict | None = None) -> dict:
    """Writes the merged model as an MXFP4 folder at `out_dir` via a temporary sibling folder; returns stats.

    settings_record: the script's settings, written as export_config.json inside the folder.
    """
    from tes_grpo.experts.mxfp4_checkpoint import (
        DEFAULT_MAX_SHARD_BYTES,
        estimate_checkpoint_bytes,
        save_tokenizer_files,
        write_mxfp4_checkpoint,
    )
    from tes_grpo.run.script_config import save_config

    if out_dir.exists() and not overwrite:
        raise ExportError(f"{out_dir} already exists; pass --OVERWRITE to replace it")
    state_dict = merged.state_dict()
    tokenizer, tokenizer_from = load_export_tokenizer(adapter_path, base_folder)
    generation = export_generation_config(base_folder, tokenizer)
    check_free_space(out_dir, estimate_checkpoint_bytes(state_dict) + disk_margin_bytes)
    passthrough = base_expert_passthrough(base_folder, state_dict, touched)
    config = merged.config
    config.use_cache = True  # training turns the KV cache off for gradient checkpointing; serving needs it
    temp = temporary_folder(out_dir)
    try:
        stats = write_mxfp4_checkpoint(state_dict, config, temp, passthrough=passthrough,
                                       max_shard_bytes=max_shard_bytes or DEFAULT_MAX_SHARD_BYTES)
        save_tokenizer_files(tokenizer, temp)
        generation.save_pretrained(temp)
        info = {"adapter": str(adapter_path), "base": str(base_folder), "tokenizer": tokenizer_from,
                "experts_copied_from_base": stats["copied"], "experts_quantized": stats["quantized"],
                "adapted_expert_parameters": sorted(touched), "bytes": stats["bytes"]}
        (temp / "export_info.json").write_text(json.dumps(info, indent=2) + "\n", encoding="utf-8")
        if settings_record is not None:
            save_config(settings_record, temp / "export_config.json")
        training, found = adapter_folder.training_config(adapter_path)
        if found is not None:  # run_exported_model.py samples as the run trained (its "auto" settings)
            save_config(training, temp / adapter_folder.TRAIN_CONFIG)
        give_default_modes(temp)
        replace_folder(temp, out_dir)
    except OSError as err:
        shutil.rmtree(temp, ignore_errors=True)
        if err.errno == errno.ENOSPC:
            raise ExportError(f"disk full while writing the export to {out_dir.parent}; nothing was replaced "
                              f"(partial files removed)") from None
        raise
    except BaseException:
        shutil.rmtree(temp, ignore_errors=True)
        raise
    return {**stats, "tokenizer": tokenizer_from}


def compare_weights(loaded_state: dict, merged_state: dict, export: "SafetensorsCheckpoint", touched: set[str]) -> dict:
    """Checks an export's loaded weights against the merged model; raises CheckFailed naming the tensor.

    Experts must equal transformers' own dequantization of the written blocks, lie within FP4 rounding
    of the merged weights, and equal them exactly where they were copied from the base. Everything
    else must equal the merged bf16 weights.
    """
    import torch
    from transformers.integrations.mxfp4 import convert_moe_packed_tensors

    from tes_grpo.experts.mxfp4 import expert_rounding_bound
    from tes_grpo.experts.mxfp4_checkpoint import EXPERT_PARAM_RE

    worst = 0.0
    for name, merged in merged_state.items():
        loaded = loaded_state[name]
        if not EXPERT_PARAM_RE.match(name):
            if not torch.equal(loaded, merged.to(loaded.dtype)):
                raise CheckFailed(f"{name}: differs from the merged model")
            continue
        blocks, scales = export[f"{name}_blocks"], export[f"{name}_scales"]
        reference = convert_moe_packed_tensors(blocks, scales, dtype=loaded.dtype)
        if not torch.equal(loaded, reference):
            raise CheckFailed(f"{name}: differs from transformers' dequantization of its blocks")
        error = (loaded.float() - merged.float()).abs()
        if not (error <= expert_rounding_bound(blocks, scales)).all():
            raise CheckFailed(f"{name}: beyond FP4 rounding")
        if name not in touched and not torch.equal(loaded, merged):
            raise CheckFailed(f"{name}: untouched by the adapter but not equal to the base")
        worst = max(worst, error.max().item())
    return {"max_expert_rounding_error": worst}


def native_mxfp4_load(out_dir: Path):
    """Loads the export without asking for dequantization; returns (model, what transformers did with the experts)."""
    import torch
    from transformers import AutoModelForCausalLM

    from tes_grpo.model.model_loading import checkpoint_is_mxfp4, expert_load_path

    model = AutoModelForCausalLM.from_pretrained(out_dir, dtype=torch.bfloat16)
    return model, expert_load_path(model, checkpoint_is_mxfp4(out_dir))


def fake_quantized_copy_logits(merged, export: "SafetensorsCheckpoint", input_ids):
    """Logits of the merged model with its experts replaced by the export's dequantized blocks (FP4 rounding only)."""
    import torch

    from tes_grpo.experts.mxfp4 import mxfp4_to_expert_param
    from tes_grpo.experts.mxfp4_checkpoint import EXPERT_PARAM_RE

    saved = {}
    params = dict(merged.named_parameters())
    with torch.no_grad():
        for name, param in params.items():
            if EXPERT_PARAM_RE.match(name):
                saved[name] = param.detach().clone()
                param.copy_(mxfp4_to_expert_param(export[f"{name}_blocks"], export[f"{name}_scales"], param.dtype))
        try:
            return merged(input_ids=input_ids).logits.float()
        finally:
            for name, value in saved.items():
                params[name].copy_(value)


def verify_export(out_dir: Path, merged, touched: set[str], check_text: str, logit_rtol: float) -> dict:
    """Reloads the export (dequantized, then as-is) and compares weights and logits with `merged`.

    check_text: the text whose logits are compared; logit_rtol: the largest allowed logit difference to the
    FP4-rounded merged model, relative to the largest logit.
    """
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer, Mxfp4Config

    from tes_grpo.experts.mxfp4_checkpoint import SafetensorsCheckpoint

    export = SafetensorsCheckpoint(out_dir)
    merged_state = merged.state_dict()
    dequantized = AutoModelForCausalLM.from_pretrained(out_dir, quantization_config=Mxfp4Config(dequantize=True),
                                                       dtype=torch.bfloat16).eval()
    report = compare_weights(dequantized.state_dict(), merged_state, export, touched)
    input_ids = AutoTokenizer.from_pretrained(out_dir)(check_text, return_tensors="pt").input_ids
    with torch.no_grad():
        export_logits = dequantized(input_ids=input_ids).logits.float()
        merged_logits = merged(input_ids=input_ids).logits.float()
    rounded_logits = fake_quantized_copy_logits(merged, export, input_ids)
    report["logit_diff_vs_merged_with_fp4_experts"] = (export_logits - rounded_logits).abs().max().item()
    report["logit_diff_vs_merged"] = (export_logits - merged_logits).abs().max().item()
    report["logit_scale"] = merged_logits.abs().max().item()
    # same weights, same ops: only float noise may separate them
    if report["logit_diff_vs_merged_with_fp4_experts"] > logit_rtol * report["logit_scale"]:
        raise CheckFailed(f"export logits differ from the merged model's (with FP4-rounded experts) by "
                          f"{report['logit_diff_vs_merged_with_fp4_experts']:.4g}, more than {logit_rtol} of their "
                          f"scale {report['logit_scale']:.4g}")
    del dequantized
    try:
        native, path = native_mxfp4_load(out_dir)
    except (OSError, RuntimeError, ImportError, ValueError) as err:
        # e.g. `kernels` installed but its kernels not reachable on the hub: say so, keep the dequantized result
        report["load_without_dequantize"] = f"FAILED: {type(err).__name__}: {err}; {_WITHOUT_NATIVE_MXFP4}"
        return report
    report["load_without_dequantize"] = path + (f"; {_WITHOUT_NATIVE_MXFP4}" if path.startswith("FELL BACK") else "")
    if path.startswith("FELL BACK"):
        compare_weights(native.state_dict(), merged_state, export, touched)
        report["load_without_dequantize_weights"] = "equal to the dequantized load"
    return report


def run_export(settings) -> dict:
    """The whole export for a script's `settings`; returns a summary dict (the check report under "check")."""
    try:
        adapter = Path(adapter_folder.resolve_adapter_path(settings.ADAPTER_PATH, print))  # <run>/best: the best one
        named_base = adapter_folder.lora_adapter_config(adapter).get("base_model_name_or_path")
    except InputError as err:
        raise ExportError(str(err)) from None
    base_id = settings.BASE_MODEL_ID or named_base
    if not base_id:
        raise ExportError(f"{adapter / run_folder.ADAPTER_CONFIG} names no base model; set --BASE_MODEL_ID")
    if not same_base(base_id, named_base) and not settings.ALLOW_OTHER_BASE:
        raise ExportError(f"adapter {adapter} was trained on {named_base!r}, not {base_id!r}; pass "
                          f"--BASE_MODEL_ID={named_base} or --ALLOW_OTHER_BASE if it is the same model elsewhere")
    out = Path(settings.OUT_DIR)
    if out.exists() and not settings.OVERWRITE:
        raise ExportError(f"{out} already exists; pass --OVERWRITE to replace it")
    try:  # a folder that is not there, or a Hub that cannot be reached: one line now, no download retries
        check_model_id(base_id, "BASE_MODEL_ID" if settings.BASE_MODEL_ID else f"{adapter}'s base model")
    except SourceError as err:
        raise ExportError(str(err)) from None
    base_folder = resolve_base_folder(base_id)
    if not (base_folder / "config.json").is_file():
        raise ExportError(f"base {base_folder} has no config.json")
    check_adapter_fits_base(adapter, base_folder)
    export_tokenizer_source(adapter, base_folder)  # no tokenizer anywhere: said now, not after the slow load
    margin = int(settings.DISK_MARGIN_GB * 1e9)
    check_free_space(out, checkpoint_bytes(base_folder) + margin)  # early estimate, before the slow load
    print(f"loading base {base_id} (dequantized to bf16) and merging adapter {adapter}")
    merged, touched = load_merged_model(base_folder, adapter)
    print(f"adapter changes {len(touched)} expert parameter(s)" + (f": {sorted(touched)}" if touched else
          " (attention LoRA only): every expert is copied bit for bit from the base"))
    stats = write_export(merged, touched, base_folder, adapter, out, overwrite=settings.OVERWRITE,
                         max_shard_bytes=int(settings.MAX_SHARD_GB * 1e9), disk_margin_bytes=margin,
                         settings_record=dict(settings))
    summary = {"out_dir": str(out), **stats}
    print(f"wrote {out}: {stats['bytes'] / 1e9:.2f} GB in {len(stats['files'])} file(s); experts copied from base "
          f"{stats['copied']}, re-quantized {stats['quantized']}; tokenizer from {stats['tokenizer']}")
    if settings.CHECK:
        report = verify_export(out, merged, touched, settings.CHECK_TEXT, settings.LOGIT_RTOL)
        summary["check"] = report
        for key, value in report.items():
            print(f"check: {key} = {value}")
    return summary


def main(argv: list[str] | None = None, environ: typing.Mapping[str, str] | None = None) -> int:
    """Export (and upload when a repo id is given); environ: where HF_TOKEN / HF_REPO_ID are read (os.environ)."""
    from tes_grpo.run.script_config import resolve

    settings = resolve(globals(), argv)
    environ = os.environ if environ is None else environ
    token = None
    try:
        try:
            target = hub_target(settings, environ)
        except HubError as err:
            raise HubError(f"{err}; nothing was exported") from None
        api = None
        if target is not None:
            from huggingface_hub import HfApi

            repo_id, token = target
            api = HfApi(token=token)
            try:
                plan = check_hub_access(api, repo_id, settings.ALLOW_PUBLIC_REPO)
            except HubError as err:
                raise HubError(f"{err}; nothing was exported (--PUSH_TO_HUB=0 exports without uploading)") from None
            print(f"upload after the export: {repo_id} ({plan}); token from HF_TOKEN")
        summary = run_export(settings)
        if target is None:
            reason = "--PUSH_TO_HUB=0" if not settings.PUSH_TO_HUB else "no HF_REPO_ID / --HUB_REPO_ID given"
            print(f"not pushed to the Hub: {reason}")
            return 0
        url, visibility = push_folder_to_hub(api, Path(summary["out_dir"]), repo_id, settings.ALLOW_PUBLIC_REPO)
        print(f"uploaded to {url} ({visibility})")
    except (ExportError, CheckFailed, HubError) as err:
        print(f"error: {redact(str(err), token)}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
