"""Trainer callbacks of train_grpo.py: the appended metrics file, one progress line per step, zero-padded
checkpoint names. Imports transformers at import time (TrainerCallback), so scripts import it inside main()."""

from __future__ import annotations

import json
import math
import time
from pathlib import Path

from transformers import TrainerCallback

from tes_grpo.run.processes import wait_for_everyone
from tes_grpo.run.run_folder import rename_checkpoint


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
    (train_grpo's GENERATION_STEPS) logs no rewards: its line says so."""

    def __init__(self):
        self.started = self.last = None
        self.first_step = self.last_step = 0

    def on_train_begin(self, args, state, control, **kwargs):
        self.started = self.last = time.time()
        self.first_step = self.last_step = state.global_step

    def on_log(self, args, state, control, logs=None, **kwargs):
        if not state.is_world_process_zero or not logs or ("reward" not in logs and "loss" not in logs):
            return  # the end-of-training summary has neither
        print("  ".join(self.progress_parts(state, logs, time.time())), flush=True)

    def progress_parts(self, state, logs: dict, now: float) -> list[str]:
        """The line's parts; the seconds are those of the steps since the last line, then the run's average (the
        first step compiles and captures, so the two differ most there)."""
        since = max(1, state.global_step - self.last_step)
        average = (now - self.started) / max(1, state.global_step - self.first_step)
        latest = (now - self.last) / since
        self.last, self.last_step = now, state.global_step
        parts = [f"step {state.global_step}/{state.max_steps}"]
        parts += [f"{label} {format_metric(logs[key])}" for key, label in PROGRESS_FIELDS if key in logs]
        if "reward" not in logs:
            parts.append("(an earlier step's generation batch)")
        parts.append(f"{latest:.1f} s/step (average {average:.1f})")
        return parts


class ZeroPaddedCheckpointNames(TrainerCallback):
    """Renames the Trainer's checkpoint-N folders to checkpoint-00000N so they sort by name (run_folder.py).
    On several processes each writes its own RNG state into the folder, so all meet before rank 0 renames it."""

    def on_save(self, args, state, control, **kwargs):
        wait_for_everyone()
        if state.is_world_process_zero:
            rename_checkpoint(Path(args.output_dir), state.global_step)
        wait_for_everyone()
