"""Decision quality of a LoRA adapter against its base model on the evaluation prompts (a report, not a pytest file).

    python test_lora_adapter.py                                          # adapter in runs/grpo-gpt-oss-20b
    python test_lora_adapter.py --ADAPTER_PATH=runs/grpo-tiny --MAX_PROMPTS=10 --SAMPLES_PER_PROMPT=2
    python test_lora_adapter.py --ADAPTER_PATH=runs/grpo-tiny/best       # the checkpoint that evaluated best
    python test_lora_adapter_quantized.py --ADAPTER_PATH=...   # the same with the MXFP4 experts kept quantized

For every prompt of PROMPT_PATH (the `*_q_dataset_harmony.csv` files of the evaluation split) it samples
SAMPLES_PER_PROMPT completions with the adapter and as many with the base model alone. The weights are loaded once;
the base pass runs inside PEFT's `disable_adapter()` with the same batches and seeds. The base is loaded through
`Mxfp4Config(dequantize=True)`: bf16 on a GPU, float32 on the CPU (DTYPE changes it). Actions are read with the
training reward's parser (`harmony.parse_action`: the last `[k]` in the final channel). MAX_COMPLETION_LEN,
TEMPERATURE and the prompts' reasoning effort follow the training run by default ("auto": train_grpo.py's
train_config.json beside the adapter, or in the run folder above a checkpoint; the effort falls back to the
dataset's when none is recorded).

Reported per model (a table on screen, OUT_DIR/completions_summary.csv, and every completion in
OUT_DIR/completions.csv):
- valid_rate: completions with a valid action (a truncated completion is invalid).
- optimal_share: completions whose action is the row's optimal_action (invalid ones count as not optimal).
- mean_reward: the row's reward_action_k of the chosen action; an invalid completion counts as reward 0 (the floor:
  the rewards are a softmax over the four actions) and is included in the mean.
- mean_regret_q: max_k Q - Q of the chosen action (reward units; x6 = kg CO2), over valid completions only.
- truncation_rate: completions that hit MAX_COMPLETION_LEN without an end token (<|return|>, <|call|>, <|endoftext|>).
"""

from __future__ import annotations

import math
import sys
from pathlib import Path

from tes_grpo.run.evaluation import evenly_spaced  # the rows train_grpo.py's evaluation takes, spread the same way
from tes_grpo.task import tes_env

ADAPTER_PATH = "runs/grpo-gpt-oss-20b"  # LoRA adapter: a run folder, one of its checkpoint-* folders, or <run>/best
PROMPT_PATH = "data/eval"  # a *_harmony.csv or a folder of them (default: the evaluation split)
BASE_MODEL_ID = ""  # base model folder or hub id; "" = the adapter's base_model_name_or_path
SAMPLES_PER_PROMPT = 4  # completions per prompt and model
MAX_PROMPTS = 0  # prompts to use, evenly spaced over all rows (0 = all)
MAX_COMPLETION_LEN = "auto"  # tokens per completion; auto = the training run's; a completion cut here is invalid
TEMPERATURE = "auto"  # sampling temperature; auto = the training run's; 0 = greedy
TOP_P = 1.0  # nucleus sampling mass (gpt-oss recommends 1.0)
TOP_K = 0  # top-k sampling (0 = off, as in training; transformers would otherwise default to 50)
SEED = 0  # generation batch b is seeded with SEED + b, the same for the adapter and the base
BATCH_SIZE = 32  # sequences per generate call (prompt x sample pairs); lower it if GPU memory runs out
REASONING_EFFORT = "auto"  # prompts' "Reasoning:" line: auto (adapter's training setting), low/medium/high, "" = keep
DEVICE = "auto"  # auto (cuda when available), cpu or cuda
DTYPE = "auto"  # auto (bf16 on GPU, float32 on CPU), bfloat16, float32 or float16; QUANTIZED forces bfloat16
ATTN_IMPLEMENTATION = "auto"  # auto (flex_attention on CUDA: it supports gpt-oss's sinks; eager on CPU) or a name
QUANTIZED = False  # keep the MXFP4 expert weights quantized where the machine can (else says it fell back)
OUT_DIR = ""  # completions.csv + completions_summary.csv go here; "" = runs/adapter-test-<adapter>[-mxfp4]/
PROGRESS = True  # progress bars while generating

_MODELS = ("adapter", "base")
_Q_COLUMNS = tes_env.Q_COLUMNS
_SUMMARY_COLUMNS = ("model", "completions", "prompts", "valid_rate", "optimal_share", "mean_reward", "mean_regret_q",
                   "truncation_rate", "mean_tokens")


# ---------------------------------------------------------------------------------------------------------------
# Prompts
# ---------------------------------------------------------------------------------------------------------------

def load_eval_prompts(path: str | Path, max_prompts: int = 0, reasoning_effort: str = ""):
    """Checked rows of the Harmony CSVs: source, row, prompt, optimal_action, reward_action_0..3, q_action_0..3."""
    import pandas as pd

    from data_reward import check_frame, check_q_columns
    from tes_grpo.model.llm_policy import prompt_files
    from tes_grpo.run.fileio import InputError, read_csv_table
    from tes_grpo.task.harmony import set_reasoning_effort

    frames = []
    for file in prompt_files(path):
        raw = read_csv_table(file)
        frame = check_frame(raw, file).drop(columns="source")
        frame = frame.assign(**check_q_columns(raw, file))
        frame.insert(0, "source", file.name)
        frame.insert(1, "row", range(1, len(frame) + 1))
        frames.append(frame)
    prompts = pd.concat(frames, ignore_index=True)
    prompts = prompts.iloc[evenly_spaced(len(prompts), max_prompts)].reset_index(drop=True)
    if reasoning_effort:
        try:
            prompts["prompt"] = [set_reasoning_effort(p, reasoning_effort) for p in prompts["prompt"]]
        except ValueError as err:
            raise InputError(path, str(err), column="prompt") from None
    return prompts


# ---------------------------------------------------------------------------------------------------------------
# Metrics
# ---------------------------------------------------------------------------------------------------------------

def score_action(action: int | None, optimal_action: int, q_values, rewards) -> dict:
    """valid, is_optimal, reward (0 when invalid) and regret_q (NaN when invalid) of one chosen action."""
    if action is None:
        return {"valid": False, "is_optimal": False, "reward": 0.0, "regret_q": math.nan}
    return {"valid": True, "is_optimal": action == int(optimal_action), "reward": float(rewards[action]),
            "regret_q": max(q_values) - q_values[action]}


def completion_rows(prompts, completions, model: str) -> list[dict]:
    """One record per completion: where its prompt came from, the action and its scores."""
    rows = []
    for record, samples in zip(prompts.to_dict("records"), completions, strict=True):
        q_values = [record[c] for c in _Q_COLUMNS]
        rewards = [record[column] for column in tes_env.REWARD_COLUMNS]
        for sample, completion in enumerate(samples):
            rows.append({"model": model, "source": record["source"], "row": record["row"], "sample": sample,
                         "optimal_action": record["optimal_action"], "action": completion.action,
                         **score_action(completion.action, record["optimal_action"], q_values, rewards),
                         "truncated": completion.truncated, "n_tokens": completion.n_tokens,
                         "completion": completion.text})
    return rows


def summarize(frame):
    """One row per model: the metrics of the module docstring over that model's completions."""
    import pandas as pd

    rows = []
    for model, group in frame.groupby("model", sort=False):
        valid = group["valid"].astype(bool)
        rows.append({
            "model": model,
            "completions": len(group),
            "prompts": group[["source", "row"]].drop_duplicates().shape[0],
            "valid_rate": valid.mean(),
            "optimal_share": group["is_optimal"].astype(bool).mean(),
            "mean_reward": group["reward"].mean(),
            "mean_regret_q": group.loc[valid, "regret_q"].mean() if valid.any() else math.nan,
            "truncation_rate": group["truncated"].astype(bool).mean(),
            "mean_tokens": group["n_tokens"].mean(),
        })
    return pd.DataFrame(rows, columns=list(_SUMMARY_COLUMNS))


def format_summary(summary) -> str:
    table = summary.copy()
    for column in ("valid_rate", "optimal_share", "truncation_rate"):
        table[column] = [f"{100 * v:.1f}%" for v in table[column]]
    for column in ("mean_reward", "mean_regret_q"):
        table[column] = ["n/a" if math.isnan(v) else f"{v:.4f}" for v in table[column]]
    table["mean_tokens"] = [f"{v:.0f}" for v in table["mean_tokens"]]
    return table.to_string(index=False)


# ---------------------------------------------------------------------------------------------------------------
# Running it
# ---------------------------------------------------------------------------------------------------------------

def default_out_dir(adapter_path: str, quantized: bool) -> Path:
    from tes_grpo.run.adapter_folder import adapter_run_name

    return Path("runs") / f"adapter-test-{adapter_run_name(adapter_path)}{'-mxfp4' if quantized else ''}"


def run_adapter_test(s):
    """Generates with the adapter and with the base (settings s), writes OUT_DIR's two CSVs; returns (summary,
    completions)."""
    import pandas as pd

    from tes_grpo.model.llm_policy import generate, load_policy_model
    from tes_grpo.run.adapter_folder import (
        checked_training_settings,
        from_training_run,
        lora_adapter_config,
        resolve_adapter_path,
    )
    from tes_grpo.run.fileio import write_csv_atomic

    s = s.replace(ADAPTER_PATH=resolve_adapter_path(s.ADAPTER_PATH, print))  # <run>/best: the best checkpoint
    lora_adapter_config(s.ADAPTER_PATH)  # a missing or unusable adapter fails before anything is read or loaded
    sampling = checked_training_settings(s, ("MAX_COMPLETION_LEN", "TEMPERATURE"), s.ADAPTER_PATH)
    effort, origin = from_training_run("REASONING_EFFORT", s.REASONING_EFFORT, s.ADAPTER_PATH, "")
    prompts = load_eval_prompts(s.PROMPT_PATH, s.MAX_PROMPTS, effort)
    policy = load_policy_model(s.BASE_MODEL_ID, s.ADAPTER_PATH, quantized=s.QUANTIZED, device=s.DEVICE,
                               dtype=s.DTYPE, attn_implementation=s.ATTN_IMPLEMENTATION)
    print(f"base {policy.base_model_id} + adapter {s.ADAPTER_PATH}; experts: {policy.experts}; "
          f"{policy.device}, {policy.dtype}, attention {policy.attention}")
    print(f"reasoning effort: {effort or 'as in the prompts'} ({origin})")
    print(f"{len(prompts)} prompts from {s.PROMPT_PATH} x {s.SAMPLES_PER_PROMPT} samples x 2 models, "
          f"max {sampling['MAX_COMPLETION_LEN']} new tokens, temperature {sampling['TEMPERATURE']}, top_p {s.TOP_P}, "
          f"seed {s.SEED}")
    rows = []
    for model in _MODELS:
        completions = generate(policy, list(prompts["prompt"]), s.SAMPLES_PER_PROMPT, s.SEED,
                               sampling["MAX_COMPLETION_LEN"], sampling["TEMPERATURE"], s.TOP_P, s.TOP_K,
                               s.BATCH_SIZE, use_adapter=model == "adapter",
                               progress=s.PROGRESS, desc=f"{model} completions")
        rows += completion_rows(prompts, completions, model)
    frame = pd.DataFrame(rows)
    frame["action"] = frame["action"].astype("Int64")  # empty cell for an invalid answer, not 1.0-style floats
    summary = summarize(frame)
    summary["experts"] = policy.experts
    out_dir = Path(s.OUT_DIR) if s.OUT_DIR else default_out_dir(s.ADAPTER_PATH, s.QUANTIZED)
    write_csv_atomic(frame, out_dir / "completions.csv")
    write_csv_atomic(summary, out_dir / "completions_summary.csv")
    print()
    print(format_summary(summary.drop(columns="experts")))
    print("\nmean reward counts an invalid answer as 0; mean regret (Q units, x6 = kg CO2) is over valid answers")
    print(f"wrote {out_dir / 'completions.csv'} ({len(frame)} completions) and {out_dir / 'completions_summary.csv'}")
    return summary, frame


def main(argv: list[str] | None = None, quantized: bool = False) -> int:
    """Command-line entry; quantized=True is test_lora_adapter_quantized.py (QUANTIZED's default becomes True)."""
    from tes_grpo.run.fileio import InputError
    from tes_grpo.run.script_config import resolve

    # a copy of the constants with QUANTIZED's default changed: --help shows it, --QUANTIZED still overrides it
    settings = resolve({**globals(), "QUANTIZED": True} if quantized else globals(), argv)
    try:
        run_adapter_test(settings)
    except (InputError, ValueError) as err:
        print(f"error: {err}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
