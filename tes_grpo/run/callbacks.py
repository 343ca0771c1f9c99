"""Trainer callbacks of train_grpo.py: the appended metrics file, one progress line per step, zero-padded
checkpoint names, and evaluation's checkpoint, best record and plot. Imports transformers at import time
(TrainerCallback), so scripts import it inside main()."""

from __future__ import annotations

import json
import math
import time
from pathlib import Path

from transformers import TrainerCallback

from tes_grpo.run.fileio import OutputError, atomic_write_text
from tes_grpo.run.plot import PLOT, write_training_plot
from tes_grpo.run.processes import wait_for_everyone
from tes_grpo.run.run_folder import best_record, padded_checkpoint_name, rename_checkpoint, write_best_record


class JsonlMetricsCallback(TrainerCallback):
    """Appends every logged metrics dict, with its step and time, to a JSON-lines file (main process only)."""

    def __init__(self, path):
        self.path = Path(path)

    def on_log(self, args, state, control, logs=None, **kwargs):
        if not state.is_world_process_zero or not logs:
            return
        self.path.parent.mkdir(parents=True, exist_ok=True)
        record = {"step": state.global_step, "time": round(time.time(), 3), **logs}
        with open(self.path, "a", encoding="utf-8") as handle:
            handle.write(json.dumps(record, default=float) + "\n")


def format_metric(value) -> str:
    """Short text for a logged metric; TRL logs None when every reward of a step was NaN."""
    if value is None or (isinstance(value, float) and math.isnan(value)):
        return "nan"
    return f"{value:.3g}" if isinstance(value, (int, float)) else str(value)


PROGRESS_FIELDS = (("reward", "reward"), ("action/valid_fraction", "valid"),
                   ("action/truncated_fraction", "truncated"), ("action/optimal_fraction", "optimal"),
                   ("loss", "loss"), ("completions/mean_length", "len"),
                   ("sampling/sampling_logp_difference/mean", "logp gap"))  # sampler vs trainer, sampling_fidelity.py


class ProgressLineCallback(TrainerCallback):
    """One line per logged step: step, reward, valid/truncated/optimal fractions, loss, length, the mean |log p| gap
    between sampler and trainer, seconds per step. A step that trains on an earlier step's generation batch
    (train_grpo's GENERATION_STEPS) logs no rewards: its line says so. An evaluation's seconds are its own line's
    (EvaluationCallback), not counted in the steps'."""

    def __init__(self):
        self.started = self.last = None
        self.first_step = self.last_step = 0
        self.evaluating = self.evaluated = 0.0  # evaluation seconds since the last line, and in all

    def on_train_begin(self, args, state, control, **kwargs):
        self.started = self.last = time.time()
        self.first_step = self.last_step = state.global_step

    def on_evaluate(self, args, state, control, metrics=None, **kwargs):
        seconds = float((metrics or {}).get("eval_runtime") or 0.0)
        self.evaluating += seconds
        self.evaluated += seconds

    def on_log(self, args, state, control, logs=None, **kwargs):
        if not state.is_world_process_zero or not logs or ("reward" not in logs and "loss" not in logs):
            return  # the end-of-training summary has neither
        print("  ".join(self.progress_parts(state, logs, time.time())), flush=True)

    def progress_parts(self, state, logs: dict, now: float) -> list[str]:
        """The line's parts; the seconds are those of the steps since the last line, then the run's average (the
        first step compiles and captures, so the two differ most there)."""
        since = max(1, state.global_step - self.last_step)
        average = (now - self.started - self.evaluated) / max(1, state.global_step - self.first_step)
        latest = (now - self.last - self.evaluating) / since
        self.last, self.last_step, self.evaluating = now, state.global_step, 0.0
        parts = [f"step {state.global_step}/{state.max_steps}"]
        parts += [f"{label} {format_metric(logs[key])}" for key, label in PROGRESS_FIELDS if key in logs]
        if "reward" not in logs:
            parts.append("(an earlier step's generation batch)")
        parts.append(f"{latest:.1f} s/step (average {average:.1f})")
        return parts


class ZeroPaddedCheckpointNames(TrainerCallback):
    """Renames the Trainer's checkpoint-N folders to checkpoint-00000N so they sort by name (run_folder.py).
    On several processes each writes its own RNG state into the folder, so all meet before rank 0 renames it.

    The Trainer records a new best checkpoint (BEST_METRIC) by its plain name before the rename, in its state and in
    the checkpoint's trainer_state.json; both are pointed at the renamed folder, or the rotation (which keeps the
    best by its path) would delete it and a resumed run would drop it as missing."""

    def on_save(self, args, state, control, **kwargs):
        wait_for_everyone()
        plain = Path(args.output_dir) / f"checkpoint-{state.global_step}"
        padded = Path(args.output_dir) / padded_checkpoint_name(state.global_step)
        renamed = state.best_model_checkpoint is not None and Path(state.best_model_checkpoint) == plain
        if renamed:
            state.best_model_checkpoint = str(padded)
        if state.is_world_process_zero:
            rename_checkpoint(Path(args.output_dir), state.global_step)
            saved = padded / "trainer_state.json"
            if renamed and saved.is_file():
                recorded = json.loads(saved.read_text(encoding="utf-8"))
                recorded["best_model_checkpoint"] = str(padded)
                atomic_write_text(saved, json.dumps(recorded, indent=2, sort_keys=True) + "\n")
        wait_for_everyone()


class EvaluationCallback(TrainerCallback):
    """Evaluation during training (run/evaluation.py), main process writing: every evaluation also saves a
    checkpoint (so the best evaluation is a checkpoint), the last step is evaluated too; after each evaluation one
    line with its quantities, and after its checkpoint is saved best_checkpoint.json and the plot (training.png) are
    rewritten; the plot again at the end. Goes after ZeroPaddedCheckpointNames (it reads the renamed folder)."""

    FIELDS = (("eval_action/mean_reward", "reward"), ("eval_action/valid_fraction", "valid"),
              ("eval_action/optimal_fraction", "optimal"), ("eval_action/mean_regret_q", "regret"),
              ("eval_action/truncated_fraction", "truncated"), ("eval_completions/mean_length", "len"),
              ("eval_runtime", "s"))

    def __init__(self, out, metric: str, say=print, plot=write_training_plot):
        self.out, self.metric, self.say, self.plot = Path(out), metric, say, plot
        self.best_step = None

    def on_train_begin(self, args, state, control, **kwargs):
        self.best_step = state.best_global_step if state.best_model_checkpoint else None

    def on_step_end(self, args, state, control, **kwargs):
        if state.global_step >= state.max_steps:
            control.should_evaluate = True
        if control.should_evaluate:
            control.should_save = True
        return control

    def on_evaluate(self, args, state, control, metrics=None, **kwargs):
        if not state.is_world_process_zero or not metrics:
            return
        parts = [f"{label} {format_metric(metrics[key])}" for key, label in self.FIELDS if key in metrics]
        self.say(f"eval at step {state.global_step}: " + "  ".join(parts))
        if not control.should_save:  # at step 0 (EVAL_AT_START) no checkpoint follows
            self.write_plot(state)

    def on_save(self, args, state, control, **kwargs):
        if not state.is_world_process_zero:
            return
        record = best_record({"best_model_checkpoint": state.best_model_checkpoint, "best_metric": state.best_metric,
                              "best_global_step": state.best_global_step, "log_history": state.log_history},
                             self.metric)
        write_best_record(self.out, record)
        if record is not None and record["step"] != self.best_step:
            self.best_step = record["step"]
            self.say(f"best so far: {record['folder']} ({self.metric} {format_metric(record['value'])}; "
                     f"{self.out / 'best_checkpoint.json'})")
        self.write_plot(state)

    def on_train_end(self, args, state, control, **kwargs):
        if state.is_world_process_zero:
            self.write_plot(state)

    def write_plot(self, state) -> None:
        best = state.best_global_step if state.best_model_checkpoint else None
        try:
            self.plot(self.out, state.log_history, best, self.metric)
        except (ImportError, OutputError) as err:  # the run goes on: the plot is a view of metrics.jsonl
            self.say(f"note: {PLOT} not written: {err}")


def run_callbacks(out, best_metric: str | None, say=print) -> list:
    """train_grpo's callbacks in the order they must run: metrics.jsonl, the progress line, the checkpoint names,
    and with evaluation on (best_metric: BEST_METRIC; None = off) the evaluation's."""
    out = Path(out)
    callbacks = [JsonlMetricsCallback(out / "metrics.jsonl"), ProgressLineCallback(), ZeroPaddedCheckpointNames()]
    return callbacks + ([EvaluationCallback(out, best_metric, say)] if best_metric else [])
