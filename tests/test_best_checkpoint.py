"""The best checkpoint of evaluation during training: every evaluation saves, the best keeps its zero-padded name
and survives the rotation, resume keeps the evaluation history and the best, `<run>/best` for the evaluation
scripts and the exporter; and the training plot (tes_grpo/run/plot.py)."""

from __future__ import annotations

import json
from pathlib import Path
from types import SimpleNamespace

import pytest
from transformers import TrainerControl, TrainerState
from transformers.trainer_utils import rotate_checkpoints

from tes_grpo.run.adapter_folder import resolve_adapter_path
from tes_grpo.run.callbacks import EvaluationCallback, ProgressLineCallback, ZeroPaddedCheckpointNames
from tes_grpo.run.fileio import InputError
from tes_grpo.run.plot import PLOT, best_text, rolling_mean, series, smoothing_window, write_training_plot
from tes_grpo.run.run_folder import BEST_RECORD, best_record, prepare_resume, read_best_record, write_best_record

PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"


# ---------------------------------------------------------------------------------------------------------------
# The callbacks: an evaluation saves, the best keeps its zero-padded name, the rotation spares it
# ---------------------------------------------------------------------------------------------------------------

# (global step, max steps, evaluation due by the schedule, -> evaluate?, save?)
CONTROLS = [
    (10, 30, True, True, True),  # a scheduled evaluation also saves a checkpoint
    (11, 30, False, False, False),  # nothing due
    (30, 30, False, True, True),  # the last step is always evaluated (and saved)
]


@pytest.mark.parametrize("step, last, due, evaluate, save", CONTROLS)
def test_every_evaluation_saves_a_checkpoint(tmp_path, step, last, due, evaluate, save):
    control = TrainerControl(should_evaluate=due)
    state = TrainerState(global_step=step, max_steps=last)
    EvaluationCallback(tmp_path, "eval_action/mean_reward").on_step_end(None, state, control)
    assert (control.should_evaluate, control.should_save) == (evaluate, save)


def save_checkpoint(out: Path, step: int, state: TrainerState) -> None:
    """What HF Trainer's _save_checkpoint leaves: checkpoint-<step> with the state, naming a new best by the plain
    folder name (it exists), an older best as it was recorded."""
    plain = out / f"checkpoint-{step}"
    plain.mkdir(parents=True)
    (plain / "adapter_config.json").write_text("{}")
    if state.best_global_step == step:
        state.best_model_checkpoint = str(plain)
    state.global_step = step
    state.save_to_json(str(plain / "trainer_state.json"))


def test_the_best_checkpoint_keeps_its_padded_name_and_survives_the_rotation(tmp_path):
    out = tmp_path / "run"
    args = SimpleNamespace(output_dir=str(out))
    state = TrainerState(best_metric=0.6, best_global_step=10)
    said, plots = [], []
    callbacks = [ZeroPaddedCheckpointNames(),
                 EvaluationCallback(out, "eval_action/mean_reward", said.append, lambda *a: plots.append(a))]
    for step in (10, 20, 30):  # the best stays at step 10
        save_checkpoint(out, step, state)
        rotate_checkpoints(str(out), save_total_limit=2, best_model_checkpoint=state.best_model_checkpoint,
                           use_mtime=True)  # as _save_checkpoint does before the callbacks
        for callback in callbacks:
            callback.on_save(args, state, TrainerControl())
    assert state.best_model_checkpoint == str(out / "checkpoint-000010")
    assert sorted(p.name for p in out.glob("checkpoint-*")) == ["checkpoint-000010", "checkpoint-000030"]
    recorded = json.loads((out / "checkpoint-000010" / "trainer_state.json").read_text())
    assert recorded["best_model_checkpoint"] == str(out / "checkpoint-000010")  # a resume finds it
    assert read_best_record(out) == {"step": 10, "folder": "checkpoint-000010", "metric": "eval_action/mean_reward",
                                     "value": 0.6, "evaluation": {}}
    assert said == [f"best so far: checkpoint-000010 (eval_action/mean_reward 0.6; {out / BEST_RECORD})"]
    assert [plot[2] for plot in plots] == [10, 10, 10]  # the plot after each save marks the best


def test_without_the_padded_name_the_rotation_would_delete_the_best(tmp_path):
    """Why ZeroPaddedCheckpointNames renames the best too: transformers keeps the best by its path."""
    for step in (10, 20, 30):
        (tmp_path / f"checkpoint-{step:06d}").mkdir()
    rotate_checkpoints(str(tmp_path), save_total_limit=2, best_model_checkpoint=str(tmp_path / "checkpoint-10"))
    assert sorted(p.name for p in tmp_path.iterdir()) == ["checkpoint-000020", "checkpoint-000030"]


def test_an_evaluation_is_one_line_and_its_seconds_leave_the_step_times(tmp_path):
    said = []
    metrics = {"eval_action/mean_reward": 0.41, "eval_action/valid_fraction": 0.9, "eval_action/optimal_fraction":
               0.5, "eval_action/mean_regret_q": None, "eval_completions/mean_length": 23.2, "eval_runtime": 8.0}
    state = TrainerState(global_step=10, max_steps=30)
    EvaluationCallback(tmp_path, "eval_action/mean_reward", said.append, lambda *a: None).on_evaluate(
        None, state, TrainerControl(should_save=True), metrics=metrics)
    assert said == ["eval at step 10: reward 0.41  valid 0.9  optimal 0.5  regret nan  len 23.2  s 8"]
    line = ProgressLineCallback()
    line.started = line.last = 100.0
    line.on_evaluate(None, state, None, metrics=metrics)
    parts = line.progress_parts(SimpleNamespace(global_step=2, max_steps=30), {"reward": 0.5}, 120.0)
    assert parts[-1] == "6.0 s/step (average 6.0)"  # 20 s, 8 of them evaluating, over 2 steps


# ---------------------------------------------------------------------------------------------------------------
# Resume: the evaluation history and the best survive; `<run>/best` for the evaluation scripts
# ---------------------------------------------------------------------------------------------------------------

def make_run(out: Path, best_in_checkpoint: int | None, record_step: int | None) -> None:
    """A run folder at step 30 with evaluations at 0, 10, 20, 30; checkpoint-000020's state has the best at
    best_in_checkpoint; best_checkpoint.json names record_step (a later evaluation, say)."""
    rows = [{"step": s, "reward": 0.1 * s} for s in range(1, 31)]
    evals = [{"step": s, "eval_action/mean_reward": r} for s, r in ((0, 0.2), (10, 0.5), (20, 0.4), (30, 0.7))]
    records = sorted(rows + evals, key=lambda r: (r["step"], "eval_action/mean_reward" in r))
    out.mkdir(parents=True)
    (out / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
    for step in (10, 20, 30):
        folder = out / f"checkpoint-{step:06d}"
        folder.mkdir()
        (folder / "adapter_config.json").write_text("{}")
        state = {"global_step": step, "log_history": [r for r in records if r["step"] <= step]}
        if best_in_checkpoint is not None:
            state.update(best_global_step=best_in_checkpoint, best_metric=0.5,
                         best_model_checkpoint=str(out / f"checkpoint-{best_in_checkpoint:06d}"))
        (folder / "trainer_state.json").write_text(json.dumps(state))
    if record_step is not None:  # as EvaluationCallback wrote it after that evaluation
        value = next(r["eval_action/mean_reward"] for r in evals if r["step"] == record_step)
        write_best_record(out, {"step": record_step, "folder": f"checkpoint-{record_step:06d}",
                                "metric": "eval_action/mean_reward", "value": value,
                                "evaluation": {"eval_action/mean_reward": value}})


# (best in checkpoint-000020's state, best_checkpoint.json's step before, after resuming from it, said)
RESUMES = [
    (10, 30, 10, True),  # the record of the abandoned step-30 evaluation goes back to the checkpoint's best
    (10, 10, 10, False),  # already as the checkpoint has it: untouched
    (None, 30, None, True),  # the checkpoint had no best yet: no record
    (10, None, 10, False),  # no record (a folder from before evaluation): written from the state
]


@pytest.mark.parametrize("in_checkpoint, before, after, said", RESUMES)
def test_resume_keeps_the_evaluation_history_and_the_best(tmp_path, in_checkpoint, before, after, said):
    out = tmp_path / "run"
    make_run(out, in_checkpoint, before)
    lines = []
    checkpoint, step = prepare_resume(out, str(out / "checkpoint-000020"), None, 1, lines.append)
    assert step == 20
    kept = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in kept if "eval_action/mean_reward" in r] == [0, 10, 20]  # the evaluation history
    assert [r["step"] for r in kept if "reward" in r] == list(range(1, 21))
    record = read_best_record(out)
    assert (record and record["step"]) == after
    if after is not None:
        assert record["folder"] == f"checkpoint-{after:06d}"
        assert record["evaluation"] == {"eval_action/mean_reward": 0.5}  # that evaluation's quantities
        assert record["metric"] == ("eval_action/mean_reward" if before else None)
    assert any(BEST_RECORD in line for line in lines) is said


def test_best_record_reads_the_trainer_state():
    state = {"best_model_checkpoint": "runs/x/checkpoint-000020", "best_metric": 0.4, "best_global_step": 20,
             "log_history": [{"step": 20, "loss": 0.1}, {"step": 20, "eval_action/valid_fraction": 0.9}]}
    assert best_record(state, "m") == {"step": 20, "folder": "checkpoint-000020", "metric": "m", "value": 0.4,
                                       "evaluation": {"eval_action/valid_fraction": 0.9}}
    assert best_record({"best_model_checkpoint": None}, "m") is None  # nothing evaluated yet


def adapter_run(tmp_path: Path, record: dict | str | None) -> Path:
    run = tmp_path / "run"
    (run / "checkpoint-000020").mkdir(parents=True)
    (run / "checkpoint-000020" / "adapter_config.json").write_text("{}")
    if isinstance(record, dict):
        write_best_record(run, record)
    elif isinstance(record, str):
        (run / BEST_RECORD).write_text(record)
    return run


GOOD_RECORD = {"step": 20, "folder": "checkpoint-000020", "metric": "eval_action/mean_reward", "value": 0.4}

# (best_checkpoint.json: a record, raw text or none; ADAPTER_PATH in the run folder; the folder it resolves to)
ADAPTER_PATHS = [
    (GOOD_RECORD, "best", "checkpoint-000020"),  # <run>/best: the recorded checkpoint
    (GOOD_RECORD, "checkpoint-000020", "checkpoint-000020"),  # a checkpoint: itself
    (None, "checkpoint-000020", "checkpoint-000020"),  # a checkpoint of a run without evaluation: itself
    (GOOD_RECORD, "adapter", "adapter"),  # any other path: itself, checked later by its user
]


@pytest.mark.parametrize("record, given, expected", ADAPTER_PATHS)
def test_best_as_the_adapter_path(tmp_path, record, given, expected):
    run = adapter_run(tmp_path, record)
    assert resolve_adapter_path(str(run / given)) == str(run / expected)
    assert resolve_adapter_path("") == ""  # no adapter (evaluate_policy.py's baselines)


# (best_checkpoint.json: a record, raw text or none; words of the one-line error for <run>/best)
BAD_BESTS = [
    (None, "missing: {run} has no best checkpoint yet"),  # EVAL_STEPS=0, or no evaluation so far
    ({**GOOD_RECORD, "folder": "checkpoint-000010"}, "names checkpoint-000010, which is not a checkpoint"),  # rotated
    ("{not json", "does not read"),  # a torn record
    ('{"step": 20}', "names no checkpoint folder"),
]


@pytest.mark.parametrize("record, words", BAD_BESTS)
def test_a_best_that_cannot_be_used_is_one_error(tmp_path, record, words):
    run = adapter_run(tmp_path, record)
    with pytest.raises(InputError) as err:
        resolve_adapter_path(str(run / "best"))
    assert words.format(run=run) in str(err.value) and str(run / BEST_RECORD) in str(err.value)
    assert "\n" not in str(err.value)


def test_a_folder_named_best_is_itself(tmp_path):
    (tmp_path / "best").mkdir()
    assert resolve_adapter_path(str(tmp_path / "best")) == str(tmp_path / "best")


@pytest.mark.parametrize("script", ["test_lora_adapter", "evaluate_policy"])
def test_the_evaluation_scripts_take_best_and_fail_clearly_without_one(tmp_path, script, capsys):
    import importlib

    run = adapter_run(tmp_path, None)
    code = importlib.import_module(script).main([f"--ADAPTER_PATH={run / 'best'}", f"--OUT_DIR={tmp_path / 'o'}"])
    err = capsys.readouterr().err
    assert code == 1 and f"{run / BEST_RECORD}: missing: {run} has no best checkpoint yet" in err


def test_the_exporter_takes_best(tmp_path, capsys):
    import export_quantized_model as export
    from tes_grpo.run.script_config import resolve

    run = adapter_run(tmp_path, GOOD_RECORD)
    settings = resolve(vars(export), [f"--ADAPTER_PATH={run / 'best'}", f"--OUT_DIR={tmp_path / 'o'}"])
    with pytest.raises(export.ExportError) as err:  # the checkpoint's adapter is checked next: this one is a stub
        export.run_export(settings)
    assert str(run / "checkpoint-000020") in str(err.value)
    assert f"ADAPTER_PATH={run / 'best'}: {run / 'checkpoint-000020'}, the checkpoint that evaluated best" in \
        capsys.readouterr().out


# ---------------------------------------------------------------------------------------------------------------
# The plot
# ---------------------------------------------------------------------------------------------------------------

RECORDS = [
    {"step": 0, "eval_action/mean_reward": 0.2, "eval_action/optimal_fraction": 0.3},
    {"step": 1, "reward": 0.1, "action/mean_reward": 0.1, "action/optimal_fraction": 0.0},
    {"step": 2, "reward": 0.5, "action/optimal_fraction": 0.5},  # an older log without action/mean_reward
    {"step": 2, "eval_action/mean_reward": 0.45, "eval_action/optimal_fraction": None},  # None: nothing valid
    {"step": 3, "loss": 0.1},  # a step trained on an earlier generation batch
    {"train_runtime": 9.0},  # the end-of-training summary has no step
]


def test_the_plots_series():
    assert series(RECORDS, ("action/mean_reward", "reward"), False) == [(1, 0.1), (2, 0.5)]
    assert series(RECORDS, ("eval_action/mean_reward",), True) == [(0, 0.2), (2, 0.45)]
    assert series(RECORDS, ("eval_action/optimal_fraction",), True) == [(0, 0.3)]
    assert rolling_mean([1.0, 2.0, 3.0, 4.0], 2) == [1.0, 1.5, 2.5, 3.5]
    assert [smoothing_window(n) for n in (4, 30, 200, 1000)] == [2, 5, 20, 20]
    assert best_text(RECORDS, 2, "eval_action/mean_reward") == \
        "best checkpoint at step 2 (eval_action/mean_reward 0.450)"
    assert best_text(RECORDS, None, None) == "no best checkpoint yet"


def test_the_plot_is_a_png_written_whole(tmp_path):
    path = write_training_plot(tmp_path, RECORDS, 2, "eval_action/mean_reward")
    assert path == tmp_path / PLOT and path.read_bytes().startswith(PNG_SIGNATURE)
    assert [p.name for p in tmp_path.iterdir()] == [PLOT]  # no temporary file left
    assert write_training_plot(tmp_path, [], None, None).read_bytes().startswith(PNG_SIGNATURE)  # nothing logged
