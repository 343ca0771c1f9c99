"""Evaluation during training (tes_grpo/run/evaluation.py and what serves it): the settings and their errors, the
schedule and TRL's evaluation arguments, the split and the reward's evaluation quantities; then one tiny end-to-end
run (slow). tests/test_best_checkpoint.py has the best checkpoint, resume and the plot."""

from __future__ import annotations

import json
import math
import shutil
from pathlib import Path
from types import SimpleNamespace

import pandas as pd
import pytest

import train_grpo
from data_reward import LOG_COLUMNS, CompletionLog, load_eval_frame, reward_fn
from tes_grpo.run import evaluation
from tes_grpo.run.adapter_folder import resolve_adapter_path
from tes_grpo.run.fileio import InputError
from tes_grpo.run.plot import PLOT
from tes_grpo.run.run_folder import read_best_record
from tes_grpo.training.batch_layout import batch_layout

PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"


# ---------------------------------------------------------------------------------------------------------------
# Settings: the schedule and the errors, before anything slow
# ---------------------------------------------------------------------------------------------------------------

# (overrides, the optimizer steps between evaluations, evaluating?)
SCHEDULES = [
    ({}, 20, True),  # auto: where checkpoints are saved (SAVE_STEPS=20)
    ({"SAVE_STEPS": 10}, 10, True),  # auto follows SAVE_STEPS
    ({"EVAL_STEPS": "5"}, 5, True),  # as given on the command line (the default is the text "auto")
    ({"EVAL_STEPS": 7}, 7, True),  # a number from Python
    ({"EVAL_STEPS": "0"}, 0, False),  # 0 turns evaluation off
    ({"EVAL_STEPS": " AUTO "}, 20, True),  # case and spaces do not matter
]


@pytest.mark.parametrize("overrides, steps, on", SCHEDULES)
def test_eval_steps(overrides, steps, on):
    settings = train_grpo.default_settings(**overrides)
    assert (evaluation.eval_steps(settings), evaluation.evaluating(settings)) == (steps, on)


# (overrides, words of the one-line error: the setting and its value)
BAD_EVAL_SETTINGS = [
    ({"EVAL_STEPS": "-2"}, "EVAL_STEPS='-2'"),  # negative
    ({"EVAL_STEPS": "often"}, "EVAL_STEPS='often'"),  # neither auto nor a number
    ({"EVAL_STEPS": "2.5"}, "EVAL_STEPS='2.5'"),  # not whole
    ({"EVAL_PROMPTS": 0}, "EVAL_PROMPTS=0"),
    ({"EVAL_PROMPTS": -4}, "EVAL_PROMPTS=-4"),
    ({"EVAL_SAMPLES": 0}, "EVAL_SAMPLES=0"),
    ({"EVAL_SAMPLES": 0, "EVAL_STEPS": "0"}, "EVAL_SAMPLES=0"),  # checked with evaluation off too
    ({"EVAL_SAMPLES": 32}, "EVAL_SAMPLES=32: must be at most NUM_GENERATIONS=16"),
    ({"GENERATION_STEPS": 2, "EVAL_STEPS": "3"}, "EVAL_STEPS=3: must be a multiple of GENERATION_STEPS=2"),
    ({"KEEP_CHECKPOINTS": 1}, "KEEP_CHECKPOINTS=1 with evaluation on"),  # transformers would delete the newest
]


@pytest.mark.parametrize("overrides, words", BAD_EVAL_SETTINGS)
def test_bad_evaluation_settings(overrides, words):
    with pytest.raises(train_grpo.SettingsError) as err:
        train_grpo.check_settings(train_grpo.default_settings(**overrides))
    assert words in str(err.value) and "\n" not in str(err.value)


# settings that work: evaluation off lifts the rules that only evaluation needs
GOOD_EVAL_SETTINGS = [
    {"EVAL_STEPS": "0", "KEEP_CHECKPOINTS": 1},  # no evaluation: one checkpoint kept is fine
    {"EVAL_STEPS": "0", "EVAL_SAMPLES": 32},  # no evaluation: no group to fit
    {"KEEP_CHECKPOINTS": 2},  # the newest and the best
    {"GENERATION_STEPS": 2, "EVAL_STEPS": "4"},
    {"BEST_METRIC": "eval_action/optimal_fraction"},
]


@pytest.mark.parametrize("overrides", GOOD_EVAL_SETTINGS)
def test_good_evaluation_settings(overrides):
    train_grpo.check_settings(train_grpo.default_settings(**overrides))


def test_best_metric_is_one_of_a_fixed_set():
    with pytest.raises(train_grpo.SettingsError, match="BEST_METRIC='eval_loss'"):  # evaluation computes no loss
        train_grpo.check_settings(train_grpo.default_settings(BEST_METRIC="eval_loss"))
    assert train_grpo.CHOICES["BEST_METRIC"] == ("eval_action/mean_reward", "eval_action/optimal_fraction",
                                                 "eval_action/valid_fraction")


# (cuda, overrides, generation batch, expected completions per evaluation batch)
EVAL_BATCHES = [
    (True, {}, 64, 64),  # the recipe: 4 prompts x 16, the shape of a training generation batch
    (True, {"EVAL_PROMPTS": 16, "EVAL_SAMPLES": 4}, 64, 16),  # at most 4 distinct prompts a batch, as training
    (True, {"EVAL_PROMPTS": 2}, 64, 32),  # fewer prompts than a batch holds
    (True, {"GENERATION_STEPS": 2, "EVAL_PROMPTS": 16}, 128, 128),  # a bigger generation batch: 8 prompts
    (False, {"EVAL_PROMPTS": 64, "EVAL_SAMPLES": 1}, 16, 16),  # CPU: the sequences of one generation batch
    (False, {"EVAL_PROMPTS": 3, "EVAL_SAMPLES": 8}, 16, 16),  # whole prompts only: 2 of 3
]


@pytest.mark.parametrize("cuda, overrides, generation_batch, expected", EVAL_BATCHES)
def test_eval_batch_size(cuda, overrides, generation_batch, expected):
    settings = train_grpo.default_settings(**overrides)
    assert evaluation.eval_batch_size(settings, {"generation_batch": generation_batch}, cuda) == expected


# (overrides, evaluate, first_run, expected GRPOConfig fields)
GRPO_EVALUATION = [
    ({}, True, True, {"eval_strategy": "steps", "eval_steps": 20, "per_device_eval_batch_size": 64,
                      "num_generations_eval": 16, "eval_on_start": True,
                      "metric_for_best_model": "eval_action/mean_reward", "greater_is_better": True}),
    ({}, True, False, {"eval_strategy": "steps", "eval_on_start": False}),  # resumed: step 0 was evaluated
    ({"EVAL_AT_START": False}, True, True, {"eval_on_start": False}),
    ({"EVAL_STEPS": "0"}, True, True, {"eval_strategy": "no", "metric_for_best_model": None}),  # off
    ({}, False, True, {"eval_strategy": "no"}),  # a trainer without evaluation rows (benchmarks)
]


@pytest.mark.parametrize("overrides, evaluate, first_run, expected", GRPO_EVALUATION)
def test_grpo_config_evaluation(tmp_path, overrides, evaluate, first_run, expected):
    settings = train_grpo.default_settings(OUT_DIR=str(tmp_path), **overrides)
    args = train_grpo.build_grpo_config(settings, batch_layout(settings, 871), cuda=False, evaluate=evaluate,
                                        first_run=first_run)
    assert {name: getattr(args, name) for name in expected} == expected
    assert args.save_steps == 20  # checkpoints stay on SAVE_STEPS; evaluation adds its own


# ---------------------------------------------------------------------------------------------------------------
# The evaluation split and the reward's evaluation quantities
# ---------------------------------------------------------------------------------------------------------------

def test_the_split_is_the_repositorys_with_q_values():
    frame = load_eval_frame("data/eval")
    assert len(frame) == 90 and {"q_action_0", "q_action_3", "optimal_action"} <= set(frame.columns)
    said = []
    subset = evaluation.eval_subset(frame, 4, "data/eval", said.append)
    assert list(subset["source"]) == [frame["source"][i] for i in (0, 30, 59, 89)] and not said  # spread, fixed
    whole = evaluation.eval_subset(frame, 200, "data/eval", said.append)
    assert len(whole) == 90 and said == ["note: EVAL_PROMPTS=200, but the evaluation split data/eval has 90 "
                                         "prompt(s): evaluating on all 90"]


def bad_split(tmp_path: Path, how: str) -> Path:
    folder = tmp_path / "eval"
    if how == "missing":
        return folder
    folder.mkdir()
    frame = pd.read_csv("data/eval/tes_2024-06-15_q_dataset_harmony.csv").head(2)
    if how == "no q columns":
        frame.drop(columns=["q_action_2"]).to_csv(folder / "w_q_dataset_harmony.csv", index=False)
    elif how == "bad q value":
        frame.assign(q_action_1=["x", 1.0]).to_csv(folder / "w_q_dataset_harmony.csv", index=False)
    elif how == "header only":
        frame.head(0).to_csv(folder / "w_q_dataset_harmony.csv", index=False)
    elif how == "legacy only":
        frame.to_csv(folder / "w_q_dataset.csv", index=False)  # not Harmony: not a split file
    return folder


# (what is wrong with EVAL_DIR, words of the error)
BAD_SPLITS = [
    ("missing", "EVAL_DIR does not exist"),
    ("empty", "EVAL_DIR has no *_harmony.csv files"),
    ("legacy only", "EVAL_DIR has no *_harmony.csv files"),
    ("header only", "no data rows"),
    ("no q columns", "missing column(s) q_action_2"),
    ("bad q value", "row 1, column 'q_action_1', value 'x'"),
]


@pytest.mark.parametrize("how, words", BAD_SPLITS)
def test_a_bad_split_is_one_error_naming_it(tmp_path, how, words):
    with pytest.raises(InputError) as err:
        load_eval_frame(bad_split(tmp_path, how))
    assert words in str(err.value) and str(tmp_path / "eval") in str(err.value)


def test_no_split_is_read_with_evaluation_off():
    settings = train_grpo.default_settings(EVAL_STEPS="0", EVAL_DIR="no/such/folder")
    assert train_grpo.load_eval_data(settings, tokenizer=None) is None


def test_a_missing_split_stops_the_run_before_the_model_loads(tmp_path, tokenizer, capsys, monkeypatch):
    from grpo_fixtures import write_fixture_data

    from tes_grpo.model import model_loading

    monkeypatch.setattr(model_loading, "load_training_model", lambda *a, **k: pytest.fail("the model was loaded"))
    data = write_fixture_data(tmp_path, tokenizer)
    shutil.rmtree(data / "eval")
    code = train_grpo.main(["--MODEL_ID=tiny", f"--DATA_DIR={data}", f"--EVAL_DIR={data / 'eval'}",
                            f"--OUT_DIR={tmp_path / 'run'}"])
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 1 and err[-1] == (f"error: {data / 'eval'}: EVAL_DIR does not exist (the evaluation split, "
                                     "evaluated every EVAL_STEPS); build the datasets with the data pipeline, point "
                                     "EVAL_DIR at the split, or set EVAL_STEPS=0")


A, F, RET = "<|channel|>analysis<|message|>x<|end|>", "<|start|>assistant<|channel|>final<|message|>", "<|return|>"
REWARDS = [[0.1, 0.2, 0.3, 0.4], [0.7, 0.1, 0.1, 0.1]]  # reward_action_0..3 of two prompts
Q = [[-1.0, -0.8, -0.5, -0.2], [-0.1, -0.9, -0.9, -0.9]]  # their Q-values: optimal actions 3 and 0


def score(completions, evaluation_rows: bool, log=None):
    logged = {}
    columns = {f"reward_action_{k}": [row[k] for row in REWARDS] for k in range(4)}
    if evaluation_rows:
        columns.update({f"q_action_{k}": [row[k] for row in Q] for k in range(4)})
        columns[evaluation.SPLIT_COLUMN] = [evaluation.EVAL_SPLIT] * 2
    rewards = reward_fn(completions, **columns, optimal_action=[3, 0], prompts=["p1", "p2"], invalid_reward=math.nan,
                        log_metric=lambda name, value: logged.setdefault(name, value), completion_log=log,
                        trainer_state=SimpleNamespace(global_step=4))
    return rewards, logged


# (the two completions, Q-values given?, expected metrics)
METRICS = [
    ([f"{A}{F}[3]{RET}", f"{A}{F}[1]{RET}"], True,  # optimal, then a valid but poor answer
     {"action/valid_fraction": 1.0, "action/optimal_fraction": 0.5, "action/truncated_fraction": 0.0,
      "action/mean_reward": (0.4 + 0.1) / 2, "action/mean_regret_q": (0.0 + 0.8) / 2}),
    ([f"{A}{F}[3]{RET}", f"{A}no answer{RET}"], True,  # an invalid answer: reward 0 in the mean, no regret
     {"action/valid_fraction": 0.5, "action/optimal_fraction": 0.5, "action/mean_reward": 0.4 / 2,
      "action/mean_regret_q": 0.0}),
    ([f"{A}no{RET}", f"{A}no{RET}"], True, {"action/valid_fraction": 0.0, "action/mean_reward": 0.0,
                                             "action/mean_regret_q": math.nan}),  # TRL logs NaN as None
    ([f"{A}{F}[2]{RET}", f"{A}{F}[0]{RET}"], False, {"action/mean_reward": (0.3 + 0.7) / 2}),  # training: no Q
]


@pytest.mark.parametrize("completions, q_values, expected", METRICS)
def test_the_reward_logs_the_reports_quantities(completions, q_values, expected):
    _, logged = score(completions, q_values)
    for name, value in expected.items():
        assert logged[name] == pytest.approx(value, nan_ok=True), name
    assert ("action/mean_regret_q" in logged) is q_values


def test_evaluation_completions_stay_out_of_the_completion_log(tmp_path):
    log = CompletionLog(tmp_path / "completions.csv", 2)
    completions = [f"{A}{F}[3]{RET}", f"{A}{F}[0]{RET}"]
    score(completions, evaluation_rows=True, log=log)
    assert not log.path.exists()  # an evaluation writes nothing
    score(completions, evaluation_rows=False, log=log)
    frame = pd.read_csv(log.path)
    assert list(frame.columns) == LOG_COLUMNS and len(frame) == 2 and set(frame["step"]) == {5}


# ---------------------------------------------------------------------------------------------------------------
# End to end: a tiny run evaluating every 2 steps, resumed; and the same run without evaluation trains the same
# ---------------------------------------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def evaluated_run(tmp_path_factory, tokenizer):
    from grpo_fixtures import write_fixture_data

    root = tmp_path_factory.mktemp("eval-e2e")
    data = write_fixture_data(root, tokenizer)
    argv = ["--MODEL_ID=tiny", f"--DATA_DIR={data}", f"--EVAL_DIR={data / 'eval'}", "--NUM_GENERATIONS=4",
            "--GRADIENT_ACCUMULATION_STEPS=1", "--MAX_COMPLETION_LEN=32", "--SAVE_STEPS=2", "--EVAL_SAMPLES=4",
            "--REPORT_TO=none"]
    with pytest.MonkeyPatch.context() as mp:
        mp.delenv("GRPO_COMPLETION_LOG_PATH", raising=False)
        mp.delenv("GRPO_LOG_COMPLETIONS", raising=False)
        assert train_grpo.main([*argv, f"--OUT_DIR={root / 'plain'}", "--TOTAL_STEPS=4", "--EVAL_STEPS=0"]) == 0
        out = root / "run"
        assert train_grpo.main([*argv, f"--OUT_DIR={out}", "--TOTAL_STEPS=4", "--EVAL_STEPS=2"]) == 0
        first = {"metrics": (out / "metrics.jsonl").read_text().splitlines(),
                 "completions": (out / "completions.csv").read_text(), "record": read_best_record(out)}
        assert train_grpo.main([*argv, f"--OUT_DIR={out}", "--TOTAL_STEPS=6", "--EVAL_STEPS=2", "--RESUME=1"]) == 0
    return {"root": root, "out": out, "first": first, "data": data}


@pytest.mark.slow
def test_a_tiny_run_logs_evaluations_records_the_best_and_plots(evaluated_run):
    first = [json.loads(line) for line in evaluated_run["first"]["metrics"]]
    evals = [m for m in first if "eval_action/valid_fraction" in m]
    assert [m["step"] for m in evals] == [0, 2, 4]  # EVAL_AT_START, then every 2 steps
    for m in evals:
        assert 0 <= m["eval_action/valid_fraction"] <= 1 and 0 <= m["eval_action/optimal_fraction"] <= 1
        assert {"eval_action/mean_reward", "eval_action/truncated_fraction", "eval_completions/mean_length",
                "eval_action/mean_regret_q", "eval_runtime"} <= set(m)
    record = evaluated_run["first"]["record"]
    best = max(evals[1:], key=lambda m: m["eval_action/mean_reward"])  # step 0 (the base) has no checkpoint
    assert (record["step"], record["folder"]) == (best["step"], f"checkpoint-{best['step']:06d}")
    assert record["value"] == pytest.approx(best["eval_action/mean_reward"])


@pytest.mark.slow
def test_a_resumed_run_keeps_the_history_and_the_best(evaluated_run):
    out = evaluated_run["out"]
    metrics = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert [m["step"] for m in metrics if "eval_action/valid_fraction" in m] == [0, 2, 4, 6]  # none redone
    state = json.loads((out / "trainer_state.json").read_text())
    assert [e["step"] for e in state["log_history"] if "eval_action/valid_fraction" in e] == [0, 2, 4, 6]
    evals = [m for m in metrics if "eval_action/valid_fraction" in m and m["step"] > 0]
    best = max(evals, key=lambda m: m["eval_action/mean_reward"])
    assert state["best_model_checkpoint"] == str(out / f"checkpoint-{best['step']:06d}")
    assert resolve_adapter_path(str(out / "best")) == state["best_model_checkpoint"]
    assert (out / PLOT).read_bytes().startswith(PNG_SIGNATURE)


@pytest.mark.slow
def test_evaluation_leaves_training_as_it_was(evaluated_run):
    """The same run without evaluation samples and trains the same completions; no evaluation row is logged."""
    plain = (evaluated_run["root"] / "plain" / "completions.csv").read_text()
    assert evaluated_run["first"]["completions"] == plain
    train_prompts = set(pd.read_csv(evaluated_run["out"] / "completions.csv")["prompt"])
    eval_prompt = pd.read_csv(next((evaluated_run["data"] / "eval").glob("*.csv")))["prompt"][0]
    assert eval_prompt not in train_prompts
