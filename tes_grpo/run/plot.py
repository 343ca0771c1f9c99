"""The training plot: training.png in the run folder, rewritten after each evaluation and at the end of training.

    python -m tes_grpo.run.plot runs/grpo-tiny     # draw it again from metrics.jsonl and best_checkpoint.json

Three panels over the optimizer step: mean reward, valid share and optimal share. Each step's training value is a
faint point (16-64 completions a step make it noisy) and a rolling mean a line; the held-out evaluations
(run/evaluation.py) are the larger connected markers with their values, and the best checkpoint is a dashed line
with a star. The training reward is the reward function's action/mean_reward (an invalid answer counts 0, as in the
evaluation), TRL's reward where a log has none. matplotlib (Agg) is imported only when a plot is drawn.
"""

from __future__ import annotations

import math
import sys
from pathlib import Path

from tes_grpo.run.fileio import atomic_output

PLOT = "training.png"
# (panel title, training metric(s), evaluation metric): the first training metric a record has is used
PANELS = (("mean reward (invalid = 0)", ("action/mean_reward", "reward"), "eval_action/mean_reward"),
          ("valid share", ("action/valid_fraction",), "eval_action/valid_fraction"),
          ("optimal share", ("action/optimal_fraction",), "eval_action/optimal_fraction"))
TRAIN_COLOR, EVAL_COLOR, BEST_COLOR = "#1f77b4", "#d62728", "#2ca02c"


def _number(value) -> float | None:
    return float(value) if isinstance(value, (int, float)) and math.isfinite(value) else None


def series(records: list[dict], names, evaluation: bool) -> list[tuple[int, float]]:
    """(step, value) of the training records (TRL logs "reward" on every step that generated) or the evaluation
    records (those with eval_ keys) for the first of `names` each record has; the latest record of a step wins."""
    found = {}
    for record in records:
        if evaluation != any(str(key).startswith("eval_") for key in record) or "step" not in record:
            continue
        value = next((_number(record[name]) for name in names if name in record), None)
        if value is not None:
            found[int(record["step"])] = value
    return sorted(found.items())


def rolling_mean(values: list[float], window: int) -> list[float]:
    """The mean of each value and the window - 1 before it (fewer at the start)."""
    return [sum(values[max(0, i - window + 1):i + 1]) / len(values[max(0, i - window + 1):i + 1])
            for i in range(len(values))]


def smoothing_window(steps: int) -> int:
    """Steps in the rolling mean: about a sixth of the run, 2 to 20 steps."""
    return max(2, min(20, steps // 6))


def best_text(records: list[dict], best_step: int | None, metric: str | None) -> str:
    if best_step is None:
        return "no best checkpoint yet"
    value = dict(series(records, (metric,), True)).get(best_step) if metric else None
    return f"best checkpoint at step {best_step}" + (f" ({metric} {value:.3f})" if value is not None else "")


def write_training_plot(out, records: list[dict], best_step: int | None = None, metric: str | None = None) -> Path:
    """Draws the plot of a run's logged records (trainer log_history or metrics.jsonl) into out/training.png
    through a temporary file; best_step marks the best checkpoint, chosen by `metric`."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    out = Path(out)
    figure, axes = plt.subplots(len(PANELS), 1, figsize=(8, 7.5), sharex=True, layout="constrained")
    window = smoothing_window(len(series(records, PANELS[0][1], False)))
    for axis, (title, train_names, eval_name) in zip(axes, PANELS, strict=True):
        train = series(records, train_names, False)
        evaluated = series(records, (eval_name,), True)
        if train:
            steps, values = zip(*train, strict=True)
            axis.scatter(steps, values, s=14, color=TRAIN_COLOR, alpha=0.35, linewidths=0, label="training, each step")
            axis.plot(steps, rolling_mean(list(values), window), color=TRAIN_COLOR, linewidth=2,
                      label=f"training, mean of {window} steps")
        if evaluated:
            steps, values = zip(*evaluated, strict=True)
            axis.plot(steps, values, "o-", color=EVAL_COLOR, markersize=6, linewidth=1.5,
                      label="evaluation (held-out prompts)")
            for step, value in evaluated:  # the numbers a reader compares, beside their points (below near the top)
                axis.annotate(f"{value:.2f}", (step, value), textcoords="offset points",
                              xytext=(0, -14 if value > 0.85 else 8), ha="center", va="center", fontsize=8,
                              color=EVAL_COLOR, bbox={"boxstyle": "round,pad=0.15", "fc": "white", "ec": "none"},
                              zorder=6)
            if best_step is not None and best_step in steps:
                axis.plot([best_step], [values[steps.index(best_step)]], "*", color=BEST_COLOR, markersize=16,
                          zorder=5)
        if best_step is not None:
            axis.axvline(best_step, color=BEST_COLOR, linestyle="--", linewidth=1.2,
                         label=f"best checkpoint (step {best_step})")
        axis.set_ylim(-0.03, 1.03)
        axis.set_title(title, loc="left", fontsize=11)
        axis.grid(alpha=0.3)
    handles, labels = axes[0].get_legend_handles_labels()
    figure.legend(handles, labels, loc="outside lower center", ncol=2, fontsize=9, frameon=False)
    axes[-1].set_xlabel("optimizer step")
    axes[-1].xaxis.get_major_locator().set_params(integer=True)
    figure.suptitle(f"{out.name}: {best_text(records, best_step, metric)}", fontsize=11)
    path = out / PLOT
    try:
        with atomic_output(path, suffix=".png") as tmp:
            figure.savefig(tmp, format="png", dpi=90)
    finally:
        plt.close(figure)
    return path


def main(argv: list[str] | None = None) -> int:
    from tes_grpo.run.fileio import InputError
    from tes_grpo.run.run_folder import read_best_record, read_metrics

    args = sys.argv[1:] if argv is None else argv
    if len(args) != 1 or args[0] in ("-h", "--help"):
        print(__doc__)
        return 0 if args and args[0] in ("-h", "--help") else 2
    out = Path(args[0])
    try:
        if not (out / "metrics.jsonl").is_file():
            raise InputError(out / "metrics.jsonl", "missing: not a train_grpo.py run folder")
        record = read_best_record(out)
        path = write_training_plot(out, read_metrics(out / "metrics.jsonl"), record and record.get("step"),
                                   record and record.get("metric"))
    except InputError as err:
        print(f"error: {err}", file=sys.stderr)
        return 1
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
