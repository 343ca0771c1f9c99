"""train_grpo.py's settings rules that need no library, and the environment it reads: checked when it starts, in
about a second (torch, transformers and TRL are imported after them). Library module, not a script; train_grpo.py
imports these under their own names (its check_settings adds the rules that ask the libraries)."""

from __future__ import annotations

import math

from tes_grpo.run import evaluation
from tes_grpo.run.script_config import ConfigError, SettingsError, check_choices, parse_bool
from tes_grpo.run.trackers import report_to_problem


def _need(ok: bool, name: str, value, rule: str) -> None:
    if not ok:
        raise SettingsError(f"{name}={value!r}: {rule}")


def check_plain_settings(s, choices) -> None:
    """SettingsError naming the setting and value for train_grpo settings that cannot work, checked without
    torch or transformers; choices: the script's settings with a fixed set of values."""
    for name in ("MAX_PROMPT_LEN", "MAX_COMPLETION_LEN", "TOTAL_STEPS", "SAVE_STEPS", "LORA_R", "LOGGING_STEPS",
                 "PROMPTS_PER_STEP", "GRADIENT_ACCUMULATION_STEPS", "GENERATION_STEPS", "TRAIN_TOKENS_PER_PASS"):
        _need(s[name] >= 1, name, s[name], "must be at least 1")
    # a generation batch feeds GENERATION_STEPS steps: a checkpoint inside one would make a resumed run generate it
    # again, and a run ending inside one would sample completions that no step trains
    for name in ("SAVE_STEPS", "TOTAL_STEPS"):
        _need(s[name] % s.GENERATION_STEPS == 0, name, s[name],
              f"must be a multiple of GENERATION_STEPS={s.GENERATION_STEPS} (the steps one generation batch feeds)")
    _need(s.NUM_GENERATIONS >= 2, "NUM_GENERATIONS", s.NUM_GENERATIONS,
          "must be at least 2 (GRPO compares completions of the same prompt)")
    _need(s.KEEP_CHECKPOINTS >= 0 and s.SEED >= 0, "KEEP_CHECKPOINTS/SEED", (s.KEEP_CHECKPOINTS, s.SEED),
          "must not be negative")
    _need(math.isfinite(s.LR) and s.LR > 0, "LR", s.LR, "must be a finite number above 0")
    _need(math.isfinite(s.TEMPERATURE) and s.TEMPERATURE > 0, "TEMPERATURE", s.TEMPERATURE,
          "must be a finite number above 0 (1.0 samples as gpt-oss recommends)")
    _need(math.isfinite(s.BETA) and s.BETA >= 0, "BETA", s.BETA, "must be a finite number >= 0")
    _need(math.isfinite(s.LORA_ALPHA) and s.LORA_ALPHA > 0, "LORA_ALPHA", s.LORA_ALPHA, "must be above 0")
    _need(math.isfinite(s.WARMUP_RATIO) and 0 <= s.WARMUP_RATIO <= 1, "WARMUP_RATIO", s.WARMUP_RATIO,
          "must be between 0 and 1")
    _need(math.isfinite(s.ROUTER_AUX_LOSS_COEF) and s.ROUTER_AUX_LOSS_COEF >= 0, "ROUTER_AUX_LOSS_COEF",
          s.ROUTER_AUX_LOSS_COEF, "must be a finite number >= 0")
    _need(not math.isinf(s.INVALID_REWARD), "INVALID_REWARD", s.INVALID_REWARD, "must be a finite number or nan")
    _need(s.MEMORY_BUDGET_GB >= 0, "MEMORY_BUDGET_GB", s.MEMORY_BUDGET_GB, "must be >= 0 (0 = the GPU's free memory)")
    _need(0 < s.VLLM_GPU_MEMORY_UTILIZATION <= 1, "VLLM_GPU_MEMORY_UTILIZATION", s.VLLM_GPU_MEMORY_UTILIZATION,
          "must be in (0, 1]")
    _need(str(s.OUT_DIR).strip() != "", "OUT_DIR", s.OUT_DIR, "must name a folder")
    try:
        check_choices(s, choices)
    except ConfigError as err:
        raise SettingsError(str(err)) from None
    _need(str(s.TRAIN_BATCH_SIZE) == "auto" or str(s.TRAIN_BATCH_SIZE).isdigit() and int(s.TRAIN_BATCH_SIZE) >= 1,
          "TRAIN_BATCH_SIZE", s.TRAIN_BATCH_SIZE, "must be auto or a whole number >= 1")
    expert_layers(s)
    evaluation.check_settings(s)
    problem = report_to_problem(s.REPORT_TO)
    if problem:
        raise SettingsError(problem)


def expert_layers(s) -> list[int]:
    layers = []
    for item in s.LORA_EXPERT_LAYERS:
        try:
            layers.append(int(item))
        except ValueError:
            raise SettingsError(f"LORA_EXPERT_LAYERS: {item!r} is not a layer number") from None
    return layers


def read_environment(environ) -> dict:
    """The seed's environment variables, read once at the entry: the completion log and the generation cadence."""
    try:
        log = parse_bool("GRPO_LOG_COMPLETIONS", environ.get("GRPO_LOG_COMPLETIONS", "1"))
    except ConfigError as err:
        raise SettingsError(str(err)) from None
    steps = environ.get("GRPO_STEPS_PER_GENERATION", "").strip()
    if steps and not (steps.isdigit() and int(steps) >= 1):
        raise SettingsError(f"GRPO_STEPS_PER_GENERATION={steps!r}: must be a whole number >= 1")
    return {"log_completions": log, "completion_log_path": environ.get("GRPO_COMPLETION_LOG_PATH", ""),
            "steps_per_generation": int(steps) if steps else None}
