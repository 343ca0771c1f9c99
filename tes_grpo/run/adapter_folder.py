"""What an adapter folder says about itself and the run that trained it, for evaluation and export: the one check of
an adapter folder, its base model and adapted expert layers, the run's settings that evaluation follows, and
`<run folder>/best`.

`lora_adapter_config` is the one check of an adapter folder that evaluation (llm_policy.py, test_lora_adapter.py) and
both exporters run before anything slow; `adapter_base_model` and `adapter_expert_layers` read its
adapter_config.json; `training_config` finds the run's train_config.json in an adapter, checkpoint or merged-export
folder, and evaluation settings left at "auto" follow it (`from_training_run`, `checked_training_settings`);
`resolve_adapter_path` turns `<run folder>/best` into the checkpoint that evaluated best.
"""

from __future__ import annotations

import json
import math
import re
from pathlib import Path

from tes_grpo.run.fileio import InputError
from tes_grpo.run.run_folder import ADAPTER_CONFIG, ADAPTER_WEIGHTS, BEST_RECORD, read_best_record

TRAIN_CONFIG = "train_config.json"  # train_grpo.py's resolved settings, in the run folder (a checkpoint's parent)
AUTO = "auto"  # an evaluation setting that follows the training run (from_training_run)
BEST = "best"  # ADAPTER_PATH=<run folder>/best names the checkpoint BEST_RECORD names (resolve_adapter_path)


def resolve_adapter_path(path: str | Path, say=None) -> str:
    """ADAPTER_PATH as the evaluation scripts and the exporter take it: `<run folder>/best` is the checkpoint that
    evaluated best (best_checkpoint.json; `say` gets a line naming it), any other path itself. InputError when the
    run has no best checkpoint yet, or the one it names is gone."""
    given = Path(path)
    if str(path) == "" or given.name != BEST or given.is_dir():
        return str(path)
    run = given.parent
    record = read_best_record(run)
    if record is None:
        raise InputError(run / BEST_RECORD, f"missing: {run} has no best checkpoint yet (train_grpo.py records one at "
                         "each evaluation, every EVAL_STEPS; EVAL_STEPS=0 runs have none); give a checkpoint folder")
    folder = run / record["folder"]
    if not (folder / ADAPTER_CONFIG).is_file():
        raise InputError(run / BEST_RECORD, f"names {record['folder']}, which is not a checkpoint in {run} "
                         "(deleted?)", column="folder", value=record["folder"])
    if say is not None:
        say(f"ADAPTER_PATH={path}: {folder}, the checkpoint that evaluated best ({record.get('metric')} "
            f"{record.get('value')} at step {record.get('step')}; {run / BEST_RECORD})")
    return str(folder)


def adapter_config(adapter_path: str | Path) -> dict:
    """The adapter's adapter_config.json; InputError when the folder or the file is missing or unreadable."""
    folder = Path(adapter_path)
    if not folder.is_dir():
        raise InputError(folder, "adapter folder does not exist (train one with train_grpo.py or set ADAPTER_PATH)")
    path = folder / ADAPTER_CONFIG
    if not path.is_file():
        raise InputError(path, "missing: this is not a PEFT adapter folder (no adapter_config.json)")
    try:
        return json.loads(path.read_text(encoding="utf-8"))
    except json.JSONDecodeError as err:
        raise InputError(path, f"not valid JSON ({err})") from None


def lora_adapter_config(adapter_path: str | Path) -> dict:
    """adapter_config.json of an adapter folder that evaluation and the exporters can use, checked before anything
    slow: the folder and its adapter_config.json (adapter_config), the weights as safetensors, and a LoRA adapter.
    InputError naming the file and what is wrong."""
    folder = Path(adapter_path)
    config = adapter_config(folder)
    if not (folder / ADAPTER_WEIGHTS).is_file():
        raise InputError(folder / ADAPTER_WEIGHTS, "missing: the adapter has no weights saved as safetensors "
                         "(PEFT's save_pretrained writes them)")
    if config.get("peft_type") != "LORA":
        raise InputError(folder / ADAPTER_CONFIG, f"peft_type is {config.get('peft_type')!r}: only LoRA adapters "
                         "(what train_grpo.py trains) are evaluated and exported")
    return config


def adapter_base_model(adapter_path: str | Path) -> str:
    """The base model the adapter was trained on (its `base_model_name_or_path`)."""
    base = adapter_config(adapter_path).get("base_model_name_or_path")
    if not base:
        raise InputError(Path(adapter_path) / ADAPTER_CONFIG, "no base_model_name_or_path; set BASE_MODEL_ID",
                         column="base_model_name_or_path", value=base)
    return str(base)


def adapter_expert_layers(adapter_path: str | Path) -> list[int]:
    """The layers whose MoE experts the adapter adapts (PEFT `target_parameters` such as
    "layers.7.mlp.experts.gate_up_proj", as train_grpo's LORA_EXPERT_LAYERS writes them), sorted."""
    targets = adapter_config(adapter_path).get("target_parameters") or []
    return sorted({int(m.group(1)) for t in targets if (m := re.search(r"layers\.(\d+)\.mlp\.experts", str(t)))})


def adapter_run_name(adapter_path: str | Path) -> str:
    """A short name for output folders: "grpo-tiny" for runs/grpo-tiny, "grpo-tiny-checkpoint-000010" for a
    checkpoint."""
    folder = Path(adapter_path).resolve()
    return f"{folder.parent.name}-{folder.name}" if folder.parent.name not in ("", "runs") else folder.name


def training_config(folder: str | Path) -> tuple[dict, Path | None]:
    """train_grpo.py's train_config.json for an adapter or a merged export: in the folder, or in the run folder
    above a checkpoint; ({}, None) when neither has one."""
    folder = Path(folder)
    for candidate in (folder / TRAIN_CONFIG, folder.parent / TRAIN_CONFIG):
        if candidate.is_file():
            try:
                return json.loads(candidate.read_text(encoding="utf-8")), candidate
            except json.JSONDecodeError as err:
                raise InputError(candidate, f"not valid JSON ({err})") from None
    return {}, None


def from_training_run(name: str, requested, folder: str | Path, fallback):
    """(value, where it came from) of an evaluation setting that follows training: `requested` as set unless it is
    "auto", then the training run's value of setting `name` (train_config.json of the adapter or export in
    `folder`), else `fallback` (the dataset's or the recipe's value).
    """
    if requested != AUTO:
        return requested, "as set"
    if folder:
        config, path = training_config(folder)
        if path is not None and name in config:
            return config[name], f"the training run's {name} ({path})"
    return fallback, "no training run recorded; the recipe's default"


def _whole_number(text) -> int:
    value = int(str(text))
    if value < 1:
        raise ValueError("must be at least 1")
    return value


def _temperature(text) -> float:
    value = float(str(text))
    if not math.isfinite(value) or value < 0:
        raise ValueError("must be a finite number >= 0 (0 decodes greedily)")
    return value


# evaluation settings that can follow the training run, and how a value of each is read
FOLLOWS_TRAINING = {"MAX_COMPLETION_LEN": _whole_number, "TEMPERATURE": _temperature}


def checked_training_settings(s, names, folder: str | Path, say=print) -> dict:
    """{name: value} for evaluation settings that default to "auto" (see FOLLOWS_TRAINING): the value set, else the
    training run's from train_config.json in or above `folder`; says where each came from. ValueError naming the
    setting for a value that does not parse, or for "auto" with no training run to follow."""
    values = {}
    for name in names:
        value, origin = from_training_run(name, s[name], folder, None)
        if value is None:
            raise ValueError(f"{name}=auto follows the training run, but {folder or 'no adapter'} has no "
                             f"{TRAIN_CONFIG}; set --{name}=... (train_grpo.py --help shows the recipe's)")
        try:
            values[name] = FOLLOWS_TRAINING[name](value)
        except ValueError as err:
            raise ValueError(f"{name}={value!r} ({origin}): {err}") from None
        say(f"{name}={values[name]} ({origin})")
    return values
