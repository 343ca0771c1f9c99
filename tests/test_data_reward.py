"""Loading and checking the training CSVs, reasoning effort, prompt lengths, and the completion log."""

from __future__ import annotations

import csv
import math
from types import SimpleNamespace

import pandas as pd
import pytest
from grpo_fixtures import EVAL_ROWS, TRAIN_ROWS, write_fixture_data

import data_reward
from data_reward import (
    LOG_COLUMNS,
    CompletionLog,
    apply_reasoning_effort,
    check_prompt_lengths,
    load_training_frames,
    reward_fn,
)
from tes_grpo.run.fileio import InputError
from tes_grpo.task.harmony import set_reasoning_effort

A_F = "<|channel|>analysis<|message|>x<|end|><|start|>assistant<|channel|>final<|message|>"


@pytest.fixture(scope="module")
def data(tmp_path_factory, tokenizer):
    return write_fixture_data(tmp_path_factory.mktemp("d"), tokenizer)


def test_loads_harmony_training_files_only(data):
    frame = load_training_frames(data, data / "eval")
    assert len(frame) == len(TRAIN_ROWS)  # no eval rows, no legacy w1_q_dataset.csv rows
    assert list(frame["source"]) == ["w1_q_dataset_harmony.csv:1", "w1_q_dataset_harmony.csv:2",
                                     "w2_q_dataset_harmony.csv:1", "w2_q_dataset_harmony.csv:2"]
    assert [r for *_, r in TRAIN_ROWS] == frame[[f"reward_action_{k}" for k in range(4)]].values.tolist()
    assert EVAL_ROWS[0][2] not in frame[[f"reward_action_{k}" for k in range(4)]].values.tolist()
    assert all(p.startswith("<|start|>system") and p.endswith("<|start|>assistant") for p in frame["prompt"])


def test_eval_dir_is_not_left_out_when_not_given(data):
    assert len(load_training_frames(data, None)) == len(TRAIN_ROWS) + len(EVAL_ROWS)


def write_bad(data, tmp_path, column, row, value):
    frame = pd.read_csv(data / "train" / "w1_q_dataset_harmony.csv")
    if value is DROP:
        frame = frame.drop(columns=[column])
    else:
        frame[column] = frame[column].astype(object)
        frame.loc[row - 1, column] = value
    out = tmp_path / "bad" / "train"
    out.mkdir(parents=True)
    frame.to_csv(out / "x_q_dataset_harmony.csv", index=False)
    return tmp_path / "bad"


DROP = object()
# (column, data row, bad value, words the error must contain)
BAD_CELLS = [
    ("reward_action_2", 2, "abc", ["row 2", "'reward_action_2'", "'abc'"]),  # not a number
    ("reward_action_0", 1, "inf", ["row 1", "'reward_action_0'", "finite"]),  # not finite
    ("reward_action_3", 2, "", ["row 2", "'reward_action_3'"]),  # empty cell
    ("optimal_action", 2, "4", ["row 2", "'optimal_action'", "0..3"]),  # out of range
    ("optimal_action", 1, "1.5", ["row 1", "'optimal_action'", "1.5"]),  # not an integer
    ("optimal_action", 1, "1.0", ["row 1", "'optimal_action'", "'1.0'", "whole number"]),  # check_data refuses it too
    ("optimal_action", 2, "1e0", ["row 2", "'optimal_action'", "'1e0'", "whole number"]),  # so does check_data
    ("reward_action_3", 1, "", ["row 1", "'reward_action_3'", "missing reward", "calculate_reward.py"]),  # not yet run
    ("reward_action_1", 2, "1.5", ["row 2", "'reward_action_1'", "'1.5'", "outside [0, 1]"]),  # check_data's rule
    ("reward_action_0", 1, "-0.5", ["row 1", "'reward_action_0'", "'-0.5'", "outside [0, 1]"]),  # negative
    ("reward_action_2", 2, "0.0", ["row 2", "'reward_action_0..3'", "sum to", "not 1"]),  # no longer a softmax
    ("prompt", 2, "system:\nlegacy\n\nuser:\nx", ["row 2", "'prompt'", "Harmony"]),  # legacy text, not Harmony
    ("prompt", 1, "<|start|>user<|message|>x<|end|><|start|>assistant\n", ["row 1", "'prompt'", "whitespace after"]),
    ("reward_action_1", None, DROP, ["missing column", "reward_action_1"]),  # column missing
]


@pytest.mark.parametrize("column, row, value, words", BAD_CELLS)
def test_bad_cells_name_file_row_column_value(data, tmp_path, column, row, value, words):
    root = write_bad(data, tmp_path, column, row, value)
    with pytest.raises(InputError) as err:
        load_training_frames(root, None)
    message = str(err.value)
    assert "x_q_dataset_harmony.csv" in message
    for word in words:
        assert word in message


def test_no_training_files_is_an_error(tmp_path):
    with pytest.raises(InputError, match="no training files"):
        load_training_frames(tmp_path, None)


# (effort, expected "Reasoning:" line)
EFFORTS = [("low", "Reasoning: low\n"), ("high", "Reasoning: high\n"), ("", "Reasoning: medium\n")]


@pytest.mark.parametrize("effort, line", EFFORTS)
def test_set_reasoning_effort(data, effort, line):
    prompt = load_training_frames(data, data / "eval")["prompt"][0]
    assert "Reasoning: medium\n" in prompt
    changed = set_reasoning_effort(prompt, effort)
    assert line in changed and changed.count("Reasoning: ") == 1
    assert changed.replace(line, "Reasoning: medium\n") == prompt  # nothing else changes


def test_reasoning_effort_errors(data):
    frame = load_training_frames(data, data / "eval")
    with pytest.raises(ValueError, match="reasoning effort"):
        set_reasoning_effort(frame["prompt"][0], "extreme")
    frame.loc[1, "prompt"] = frame["prompt"][1].replace("Reasoning: medium", "Thinking: lots")
    with pytest.raises(InputError, match=r"w1_q_dataset_harmony.csv, row 2.*Reasoning"):
        apply_reasoning_effort(frame, "low")


def test_long_prompts_fail_naming_file_and_row(data, tokenizer):
    frame = load_training_frames(data, data / "eval")
    lengths = [len(tokenizer(p, add_special_tokens=False)["input_ids"]) for p in frame["prompt"]]
    limit = sorted(lengths)[1]  # the two longest prompts are over it (ties aside)
    over = [i for i, n in enumerate(lengths) if n > limit]
    with pytest.raises(InputError) as err:
        check_prompt_lengths(frame, tokenizer, limit, "error")
    file, _, row = frame["source"][over[0]].rpartition(":")
    assert f"{file}, row {row}" in str(err.value) and "MAX_PROMPT_LEN" in str(err.value)


def test_long_prompts_skipped_with_count(data, tokenizer, capsys):
    frame = load_training_frames(data, data / "eval")
    lengths = [len(tokenizer(p, add_special_tokens=False)["input_ids"]) for p in frame["prompt"]]
    limit = sorted(lengths)[1]
    kept = check_prompt_lengths(frame, tokenizer, limit, "skip")
    assert len(kept) == sum(n <= limit for n in lengths)
    # untouched, not cut
    assert set(kept["prompt"]) == {p for p, n in zip(frame["prompt"], lengths, strict=True) if n <= limit}
    assert f"skipped {len(frame) - len(kept)} of {len(frame)} prompts" in capsys.readouterr().out


# ---------------------------------------------------------------------------------------------------------------
# Completion log
# ---------------------------------------------------------------------------------------------------------------

def call_reward(prompts, actions, rewards_rows, state=None, optimal=None, log=None):
    completions = [f"{A_F}[{a}]<|return|>" if a is not None else "garbage" for a in actions]
    cols = {f"reward_action_{k}": [row[k] for row in rewards_rows] for k in range(4)}
    return reward_fn(completions, **cols, prompts=prompts, optimal_action=optimal, trainer_state=state,
                     completion_log=log, invalid_reward=math.nan)


def read_log(path):
    with open(path, newline="", encoding="utf-8") as handle:
        return list(csv.reader(handle))


def test_completion_log_rows_and_columns(tmp_path):
    path = tmp_path / "sub" / "completions.csv"
    rows = [[0.1, 0.2, 0.3, 0.4], [0.1, 0.2, 0.3, 0.4], [0.9, 0.0, 0.05, 0.05], [0.9, 0.0, 0.05, 0.05]]
    state = SimpleNamespace(global_step=6, is_world_process_zero=True)
    rewards = call_reward(["p\n1", "p\n1", "p,2", "p,2"], [3, None, 0, 2], rows, state, optimal=[3, 3, 0, 0],
                          log=CompletionLog(path, rows_per_slot=2))
    assert rewards[:1] + rewards[2:] == [0.4, 0.9, 0.05] and math.isnan(rewards[1])
    log = read_log(path)
    assert log[0] == LOG_COLUMNS
    # step is global_step + 1 (the step these completions train); micro_step: slots of 2 rows (1 prompt x 2)
    # truncated: 0 without completion ids; rank: the process that generated the row (0 without a launcher)
    assert log[1:] == [["7", "0", "p\n1", f"{A_F}[3]<|return|>", "3", "0.4", "0", "3", "0"],
                       ["7", "0", "p\n1", "garbage", "", "", "0", "3", "0"],
                       ["7", "1", "p,2", f"{A_F}[0]<|return|>", "0", "0.9", "0", "0", "0"],
                       ["7", "1", "p,2", f"{A_F}[2]<|return|>", "2", "0.05", "0", "0", "0"]]


def test_completion_log_appends_without_second_header(tmp_path):
    path = tmp_path / "completions.csv"
    for step in (0, 1):
        call_reward(["p"], [1], [[0, 1, 0, 0]], SimpleNamespace(global_step=step, is_world_process_zero=True),
                    log=CompletionLog(path))
    log = read_log(path)
    assert [r[0] for r in log] == ["step", "1", "2"]


def test_completion_log_main_process_only(tmp_path, monkeypatch):
    # rank 1 of 2 without a process group to gather through: only rank 0 may write (tests/test_distributed.py
    # checks the gathered rows of a real two-process run)
    path = tmp_path / "completions.csv"
    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.setenv("RANK", "1")
    call_reward(["p"], [1], [[0, 1, 0, 0]], SimpleNamespace(global_step=0, is_world_process_zero=False),
                log=CompletionLog(path))
    assert not path.exists()


def test_no_completion_log_writes_nothing(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    call_reward(["p"], [1], [[0, 1, 0, 0]])
    assert list(tmp_path.iterdir()) == []


def test_completion_log_target_from_rewards_without_optimal_column(tmp_path, monkeypatch):
    path = tmp_path / "completions.csv"
    monkeypatch.setattr(data_reward, "_calls_without_state", iter([5]))
    call_reward(["p"], [1], [[0.1, 0.2, 0.6, 0.1]], log=CompletionLog(path))
    assert read_log(path)[1] == ["5", "0", "p", f"{A_F}[1]<|return|>", "1", "0.2", "0", "2", "0"]


# (log rows (action logged, completion), expected summary): python data_reward.py re-scores a completion log
RESCORE_CASES = [
    ([("1", f"{A_F}[1]<|return|>")], {"completions": 1, "valid": 1, "optimal": 1, "actions_differing_from_log": 0}),
    ([("", "garbage"), ("2", f"{A_F}[2]<|return|>")],
     {"completions": 2, "valid": 1, "optimal": 0, "actions_differing_from_log": 0}),
    ([("3", f"{A_F}[1]<|return|>")], {"completions": 1, "valid": 1, "optimal": 1, "actions_differing_from_log": 1}),
]


@pytest.mark.parametrize("rows, expected", RESCORE_CASES)
def test_rescore_log(tmp_path, rows, expected, capsys):
    path = tmp_path / "completions.csv"
    with open(path, "w", newline="", encoding="utf-8") as handle:
        writer = csv.writer(handle, lineterminator="\n")
        writer.writerow(LOG_COLUMNS)
        writer.writerows([[1, 0, "p", completion, action, "", 0, 1, 0] for action, completion in rows])
    summary = data_reward.rescore_log(path)
    assert {k: summary[k] for k in expected} == expected
    assert data_reward.main([str(path)]) == 0 and "completions" in capsys.readouterr().out


def test_rescore_summary_gives_the_runs_sampler_gap(tmp_path, capsys):
    import json

    path = tmp_path / "completions.csv"
    path.write_text(",".join(LOG_COLUMNS) + "\n")
    steps = [{"step": 1, "sampling/sampling_logp_difference/mean": 0.002, "sampling/sampling_logp_difference/max": 0.5,
              "sampling/gen_kl_error": 0.0004},
             {"step": 2, "sampling/sampling_logp_difference/mean": 0.004, "sampling/sampling_logp_difference/max": 0.3,
              "sampling/gen_kl_error": 0.0008}]
    (tmp_path / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in steps))
    assert data_reward.main([str(path)]) == 0
    out = capsys.readouterr().out
    assert "over 2 logged steps: mean |log p| gap 0.003 (last step 0.004), largest 0.5" in out
    assert "gen KL 0.0006 on average, 0.0008 at most" in out


def test_rescore_missing_log_is_an_error(tmp_path, capsys):
    assert data_reward.main([str(tmp_path / "none.csv")]) == 1
    assert capsys.readouterr().err.startswith("error: ")


def test_a_duplicate_column_stops_training_before_the_model_loads(tmp_path, tokenizer, capsys):
    """pandas would rename the twin reward_action_1 to reward_action_1.1 and train on the first one silently."""
    import train_grpo

    data = write_fixture_data(tmp_path, tokenizer)
    path = data / "train" / "w1_q_dataset_harmony.csv"
    frame = pd.read_csv(path, keep_default_na=False)
    frame["twin"] = 0.9
    header, body = frame.to_csv(index=False).split("\n", 1)  # column names hold no newline; the prompts do
    path.write_text(header.replace(",twin", ",reward_action_1") + "\n" + body)
    with pytest.raises(InputError, match="reward_action_1"):
        load_training_frames(data, data / "eval")
    code = train_grpo.main(["--MODEL_ID=tiny", "--TOTAL_STEPS=1", f"--DATA_DIR={data}", f"--EVAL_DIR={data / 'eval'}",
                            f"--OUT_DIR={tmp_path / 'run'}"])
    err = capsys.readouterr().err
    assert code == 1 and "w1_q_dataset_harmony.csv" in err and "reward_action_1" in err
    assert not (tmp_path / "run" / "adapter_model.safetensors").exists()


def test_completion_log_escapes_a_lone_surrogate(tmp_path):
    """A sampled completion can decode to a lone surrogate, which UTF-8 cannot encode: escaped, never an error."""
    path = tmp_path / "completions.csv"
    reward_fn([f"{A_F}[1]<|return|>\ud800"], *([[0.1]] * 4), prompts=["p"], invalid_reward=math.nan,
              trainer_state=SimpleNamespace(global_step=0), completion_log=CompletionLog(path))
    assert read_log(path)[1][3] == f"{A_F}[1]<|return|>\\ud800"
