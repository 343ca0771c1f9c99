"""Evaluation during training: which held-out prompts, how often, how the best checkpoint is chosen.

train_grpo.py evaluates through TRL's own evaluation loop (GRPOConfig's eval_strategy="steps"): every EVAL_STEPS
optimizer steps (and at step 0 with EVAL_AT_START, and at the last step) the trainer samples EVAL_SAMPLES completions
of each of EVAL_PROMPTS prompts of the evaluation split with the training sampler, MAX_COMPLETION_LEN and
TEMPERATURE, scores them with the training reward, and logs the means under TRL's eval naming ("eval_" + the
training name) to metrics.jsonl and every tracker:

- eval_action/valid_fraction: completions with a valid, uncut answer (the report's valid_rate);
- eval_action/optimal_fraction: completions whose action is the row's optimal action (optimal_share);
- eval_action/mean_reward: the chosen action's reward, an invalid answer counting 0 (mean_reward);
- eval_action/mean_regret_q: max_k Q - Q of the chosen action over valid answers (mean_regret_q);
- eval_action/truncated_fraction: completions cut at MAX_COMPLETION_LEN (truncation_rate);
- eval_completions/mean_length: tokens per completion (mean_tokens); eval_reward: TRL's mean of the training reward
  (INVALID_REWARD for an invalid answer); eval_runtime: the evaluation's seconds.

These are test_lora_adapter.py's definitions; TRL averages each over the evaluation's generation batches, which is
the plain mean when they are of one size (the defaults), except for the regret, a mean over each batch's valid
answers.

Where TRL's loop does not fit, the trainer (training/trainer.py) differs: an evaluation computes no loss (the GRPO
loss of on-policy samples says nothing about the policy, and its forward over the whole evaluation batch would
cost memory the plan never counted), and it samples from the same random numbers each time (seeded with SEED, the
training's own random state put back after), so two checkpoints differ by their weights, not by their luck, and a
run trains the same with evaluation on or off. Every evaluation also saves a checkpoint
(callbacks.EvaluationCallback), so the best evaluation is always a checkpoint; HF Trainer's metric_for_best_model
(BEST_METRIC) records it in the trainer state and keeps it out of KEEP_CHECKPOINTS' rotation, and the run folder
names it in best_checkpoint.json (run_folder.py), which `--ADAPTER_PATH=<run folder>/best` reads.
"""

from __future__ import annotations

from tes_grpo.run.choices import BEST_METRICS
from tes_grpo.run.script_config import SettingsError

AUTO = "auto"  # EVAL_STEPS=auto: evaluate where a checkpoint is saved, every SAVE_STEPS
SPLIT_COLUMN, EVAL_SPLIT = "split", "eval"  # marks an evaluation row for the reward (kept out of completions.csv)


def eval_steps(s) -> int:
    """EVAL_STEPS in optimizer steps: auto = SAVE_STEPS, 0 = no evaluation; SettingsError for anything else."""
    value = str(s.EVAL_STEPS).strip().lower()
    if value == AUTO:
        return int(s.SAVE_STEPS)
    if not value.isdigit():
        raise SettingsError(f"EVAL_STEPS={s.EVAL_STEPS!r}: must be auto (= SAVE_STEPS) or a whole number >= 0 "
                            "(optimizer steps between evaluations; 0 = no evaluation)")
    return int(value)


def evaluating(s) -> bool:
    return eval_steps(s) > 0


def check_settings(s) -> None:
    """SettingsError naming the setting for evaluation settings that cannot work (before anything slow)."""
    steps = eval_steps(s)
    for name in ("EVAL_PROMPTS", "EVAL_SAMPLES"):
        if not isinstance(s[name], int) or s[name] < 1:
            raise SettingsError(f"{name}={s[name]!r}: must be a whole number >= 1 (EVAL_STEPS=0 turns evaluation off)")
    if s.BEST_METRIC not in BEST_METRICS:
        raise SettingsError(f"BEST_METRIC={s.BEST_METRIC!r}: must be one of {', '.join(BEST_METRICS)}")
    if steps == 0:
        return
    if steps % s.GENERATION_STEPS:  # every evaluation saves a checkpoint, which a generation batch must not straddle
        raise SettingsError(f"EVAL_STEPS={steps}: must be a multiple of GENERATION_STEPS={s.GENERATION_STEPS} (each "
                            "evaluation saves a checkpoint, and a checkpoint must not fall inside a generation batch)")
    if s.EVAL_SAMPLES > s.NUM_GENERATIONS:
        raise SettingsError(f"EVAL_SAMPLES={s.EVAL_SAMPLES}: must be at most NUM_GENERATIONS={s.NUM_GENERATIONS} (an "
                            "evaluation prompt's completions are generated together, as a training prompt's group)")
    if s.KEEP_CHECKPOINTS == 1:
        raise SettingsError("KEEP_CHECKPOINTS=1 with evaluation on: at the end of training transformers keeps only "
                            "the best checkpoint and deletes the newest; keep 2 or more (0 = all), or set EVAL_STEPS=0")


def evenly_spaced(count: int, limit: int) -> list[int]:
    """`limit` indices spread evenly over range(count), first and last included (all when limit is 0 or >= count)."""
    if limit <= 0 or limit >= count:
        return list(range(count))
    if limit == 1:
        return [0]
    return sorted({round(i * (count - 1) / (limit - 1)) for i in range(limit)})


def eval_subset(frame, prompts: int, eval_dir, say=print):
    """The fixed subset of the evaluation split: `prompts` rows spread evenly over it (every window and hour the
    split holds, the same rows at every evaluation and in every run). A split with fewer rows is used whole, with a
    note: the split's size is a property of the data, and asking for more than it has means all of it."""
    if len(frame) < prompts:
        say(f"note: EVAL_PROMPTS={prompts}, but the evaluation split {eval_dir} has {len(frame)} prompt(s): "
            f"evaluating on all {len(frame)}")
    return frame.iloc[evenly_spaced(len(frame), prompts)].reset_index(drop=True)


def eval_dataset(frame, columns):
    """The evaluation rows as the map-style dataset TRL's evaluation loop takes: the reward's columns, marked."""
    from datasets import Dataset

    records = frame[list(columns)].assign(**{SPLIT_COLUMN: EVAL_SPLIT})
    return Dataset.from_pandas(records, preserve_index=False)


def eval_batch_size(s, layout: dict, cuda: bool) -> int:
    """Completions an evaluation generates at once per process: whole prompts, never more sequences than a training
    generation batch (the recipe's 4 x 16 is one batch of training's shape). On a GPU also never more distinct
    prompts than one (its sequences / NUM_GENERATIONS), so a generate call prefills no more than the memory plan let
    training. On the CPU the tiny preset's 64 prompts x 1 then go in 4 calls of 16, which took 11 s where one call
    of 64 took 18 s (2 cores, 2026-11-29)."""
    fits = layout["generation_batch"] // (s.NUM_GENERATIONS if cuda else s.EVAL_SAMPLES)
    return min(s.EVAL_PROMPTS, max(1, fits)) * s.EVAL_SAMPLES


def grpo_config_kwargs(s, layout: dict, cuda: bool, first_run: bool = True) -> dict:
    """GRPOConfig's evaluation arguments. first_run: False on resume, where step 0 was evaluated already."""
    steps = eval_steps(s)
    if not steps:
        return {"eval_strategy": "no"}
    return {"eval_strategy": "steps", "eval_steps": steps,
            "per_device_eval_batch_size": eval_batch_size(s, layout, cuda),
            "num_generations_eval": s.EVAL_SAMPLES, "eval_on_start": bool(s.EVAL_AT_START) and first_run,
            "metric_for_best_model": s.BEST_METRIC, "greater_is_better": BEST_METRICS[s.BEST_METRIC]}


def describe(s, prompts: int, layout: dict, cuda: bool, first_run: bool = True) -> str:
    """The startup line that says what the evaluation does (first_run: False on resume, step 0 is not redone)."""
    steps = eval_steps(s)
    if not steps:
        return "evaluation: off (EVAL_STEPS=0)"
    batch = eval_batch_size(s, layout, cuda)
    total = prompts * s.EVAL_SAMPLES
    return (f"evaluation: every {steps} optimizer steps" + (", at step 0" if s.EVAL_AT_START and first_run else "")
            + f" and at step {s.TOTAL_STEPS}, each saving a checkpoint: {prompts} prompt(s) of {s.EVAL_DIR} x "
            f"{s.EVAL_SAMPLES} completions = {total}, {-(-total // batch)} generation batch(es) of up to {batch}, "
            f"the training sampler at MAX_COMPLETION_LEN={s.MAX_COMPLETION_LEN}, TEMPERATURE={s.TEMPERATURE}; "
            f"best checkpoint by {s.BEST_METRIC} (best_checkpoint.json); plot: training.png")
