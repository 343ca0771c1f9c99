"""check_data.py: every problem in the training CSVs is listed, with file, row and column; exit 1."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pandas as pd
import pytest

import check_data

REPO = Path(__file__).resolve().parents[1]
GOOD_PROMPT = "<|start|>system<|message|>x<|end|><|start|>user<|message|>y<|end|><|start|>assistant"


def good_frame(rows: int = 3) -> pd.DataFrame:
    return pd.DataFrame({
        "timestep": [str(8 + i) for i in range(rows)], "timestamp": ["2024-06-03T08:00:00"] * rows,
        "prompt": [GOOD_PROMPT] * rows, "optimal_action": ["1"] * rows,
        "q_action_0": ["-2.0"] * rows, "q_action_1": ["-1.0"] * rows, "q_action_2": ["-1.5"] * rows,
        "q_action_3": ["-3.0"] * rows,
        "reward_action_0": ["0.1"] * rows, "reward_action_1": ["0.6"] * rows, "reward_action_2": ["0.3"] * rows,
        "reward_action_3": ["0.0"] * rows, "series": ["w"] * rows,
    })


def write(frame: pd.DataFrame, path: Path) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    frame.to_csv(path, index=False, lineterminator="\n")
    return path


# ---- one bad cell in data row 2: (column, text, expected problem) -------------------------------------------
BAD_CELL_CASES = [
    ("prompt", "system:\nx\n\nuser:\ny", "row 2, column 'prompt': not a Harmony prompt"),  # legacy
    ("prompt", "", "row 2, column 'prompt': empty prompt"),  # missing prompt
    ("prompt", "<|start|>user<|message|>y<|end|>", "row 2, column 'prompt': not a Harmony prompt with the generation"),
    ("prompt", "<|start|>user<|message|>y<|end|><|start|>assistant\n", "row 2, column 'prompt': whitespace after"),
    ("q_action_2", "nan", "row 2, column 'q_action_2', value 'nan': Q-value is not finite"),  # NaN Q
    ("q_action_0", "", "row 2, column 'q_action_0': missing Q-value"),  # missing Q
    ("reward_action_3", "abc", "row 2, column 'reward_action_3', value 'abc': reward is not a number"),  # text
    ("reward_action_1", "0.7", "row 2, column 'reward_action_0..3': rewards sum to"),  # sum 1.1
    ("reward_action_3", "-0.0001", "row 2, column 'reward_action_3': reward -0.0001 is outside [0, 1]"),
    ("optimal_action", "4", "row 2, column 'optimal_action', value '4': optimal_action must be in 0..3"),  # range
    ("optimal_action", "1.0", "row 2, column 'optimal_action', value '1.0': optimal_action is not a whole"),  # float
    ("optimal_action", "1e0", "row 2, column 'optimal_action', value '1e0': optimal_action is not a whole"),
    ("optimal_action", "0", "row 2, column 'optimal_action': action 0 is not an argmax"),  # inconsistent
    ("timestep", "8.5", "row 2, column 'timestep', value '8.5': timestep is not a whole number"),
]


@pytest.mark.parametrize("column, text, message", BAD_CELL_CASES)
def test_each_bad_cell_is_reported(tmp_path, column, text, message):
    frame = good_frame()
    frame.loc[1, column] = text
    path = write(frame, tmp_path / "train" / "w_q_dataset_harmony.csv")
    files, rows, problems = check_data.check_paths([tmp_path])
    assert (files, rows) == (1, 3)
    assert any(p.startswith(f"{path}, {message}") for p in problems), problems


def test_every_problem_is_listed_across_files(tmp_path):
    a = good_frame()
    a.loc[0, "q_action_1"] = "inf"
    a.loc[2, "prompt"] = "plain text"
    b = good_frame().drop(columns=["reward_action_2"])
    write(a, tmp_path / "train" / "a_harmony.csv")
    write(b, tmp_path / "eval" / "b_harmony.csv")
    write(good_frame(), tmp_path / "train" / "c_harmony.csv")
    write(good_frame().assign(prompt="legacy"), tmp_path / "train" / "not_checked.csv")  # not a *_harmony.csv
    _, _, problems = check_data.check_paths([tmp_path])
    assert sorted(p.split(": ")[0] for p in problems) == sorted([
        f"{tmp_path / 'eval' / 'b_harmony.csv'}",
        f"{tmp_path / 'train' / 'a_harmony.csv'}, row 1, column 'q_action_1', value 'inf'",
        f"{tmp_path / 'train' / 'a_harmony.csv'}, row 3, column 'prompt'",
    ])
    assert any("b_harmony.csv: missing column(s) reward_action_2" in p for p in problems)


def test_clean_data_passes_and_empty_folders_fail(tmp_path):
    write(good_frame(), tmp_path / "x_harmony.csv")
    assert check_data.check_paths([tmp_path]) == (1, 3, [])
    (tmp_path / "empty").mkdir()
    assert "no *_harmony.csv files" in check_data.check_paths([tmp_path / "empty"])[2][0]


def test_cli_exit_codes(tmp_path):
    path = write(good_frame(), tmp_path / "x_harmony.csv")
    ok = subprocess.run([sys.executable, str(REPO / "check_data.py"), str(tmp_path)], capture_output=True, text=True)
    assert ok.returncode == 0 and "ok: 1 file(s), 3 row(s)" in ok.stdout
    frame = good_frame()
    frame.loc[0, "reward_action_0"] = "0.5"
    frame.loc[2, "q_action_3"] = "-inf"
    write(frame, path)
    bad = subprocess.run([sys.executable, str(REPO / "check_data.py"), str(path)], capture_output=True, text=True)
    assert bad.returncode == 1
    assert len(bad.stdout.strip().splitlines()) == 2 and "2 problem(s)" in bad.stderr


# ---- the tolerances are settings that reach the checks: (cells of row 2, arguments, exit status) -------------------
TOLERANCE_CASES = [
    ({"reward_action_3": "0.004"}, [], 1),  # the rewards sum to 1.004: refused by default (1e-6)
    ({"reward_action_3": "0.004"}, ["--SUM_TOLERANCE=0.005"], 0),  # accepted with a looser tolerance
    ({"reward_action_3": "0.004"}, ["--SUM_TOLERANCE=0.003"], 1),
    ({"q_action_0": "-1.05", "optimal_action": "0"}, [], 1),  # action 0 is 0.05 below the best Q
    ({"q_action_0": "-1.05", "optimal_action": "0"}, ["--ARGMAX_TOLERANCE=0.06"], 0),
]


@pytest.mark.parametrize("cells, args, code", TOLERANCE_CASES)
def test_tolerance_settings_are_followed(tmp_path, capsys, cells, args, code):
    frame = good_frame()
    for column, text in cells.items():
        frame.loc[1, column] = text
    path = write(frame, tmp_path / "x_harmony.csv")
    assert check_data.main([str(path), *args]) == code
    assert check_data.SUM_TOLERANCE == 1e-6 and check_data.ARGMAX_TOLERANCE == 1e-6  # the defaults stay
    captured = capsys.readouterr()
    assert ("ok: 1 file(s), 3 row(s)" in captured.out) == (code == 0)
    if code:
        assert captured.err.startswith("error: 1 problem(s)")


def test_byte_order_mark_is_accepted(tmp_path):
    path = write(good_frame(), tmp_path / "x_harmony.csv")
    path.write_bytes(b"\xef\xbb\xbf" + path.read_bytes())
    assert check_data.check_paths([tmp_path]) == (1, 3, [])
