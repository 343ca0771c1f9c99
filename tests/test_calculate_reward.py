"""calculate_reward.py: the Boltzmann softmax, tau checks, bad cells, outputs and atomic replacement."""

from __future__ import annotations

import math
import subprocess
import sys
from pathlib import Path

import pandas as pd
import pytest

import calculate_reward as cr
from tes_grpo.run.fileio import InputError
from tes_grpo.task import tes_env

REPO = Path(__file__).resolve().parents[1]

# ---- softmax: (q-values, tau, expected rewards) ----------------------------------------------------------
SOFTMAX_CASES = [
    ([0.0, 0.0, 0.0, 0.0], 0.05, [0.25, 0.25, 0.25, 0.25]),  # equal Q: uniform
    ([-5.0, -5.0, -5.0, -5.0], 1.0, [0.25, 0.25, 0.25, 0.25]),  # uniform whatever the level
    ([1.0, 0.0, 0.0, 0.0], 1.0, [math.e / (math.e + 3), 1 / (math.e + 3), 1 / (math.e + 3), 1 / (math.e + 3)]),
    ([0.0, math.log(2.0), math.log(3.0), math.log(4.0)], 1.0, [0.1, 0.2, 0.3, 0.4]),  # exp(q) = 1, 2, 3, 4
    ([0.0, 0.05 * math.log(3.0), 0.0, 0.0], 0.05, [1 / 6, 3 / 6, 1 / 6, 1 / 6]),  # tau scales the gap
    ([-1000.0, -1000.1, -2000.0, -1000.0], 0.05,
     [1 / (2 + math.exp(-2)), math.exp(-2) / (2 + math.exp(-2)), 0.0, 1 / (2 + math.exp(-2))]),  # no underflow to 0/0
    ([1e6, 0.0, 0.0, 0.0], 0.01, [1.0, 0.0, 0.0, 0.0]),  # no overflow to inf/inf
    ([-6.789009, -7.065398, -7.341786, -7.618175], 0.05, None),  # a real row: checked against the formula
]


@pytest.mark.parametrize("q, tau, expected", SOFTMAX_CASES)
def test_boltzmann_softmax(q, tau, expected):
    rewards = cr.boltzmann(q, tau)
    if expected is None:
        weights = [math.exp(v / tau) for v in q]
        expected = [w / sum(weights) for w in weights]
    assert rewards == pytest.approx(expected, abs=1e-12)
    assert math.fsum(rewards) == pytest.approx(1.0, abs=1e-12)
    assert all(math.isfinite(r) and 0.0 <= r <= 1.0 for r in rewards)


# ---- tau: (value, valid?) -----------------------------------------------------------------------------
TAU_CASES = [
    (0.05, True),  # the default
    (3, True),  # an int is fine
    (0.0, False),  # zero
    (-0.1, False),  # negative
    (math.inf, False),  # infinite
    (math.nan, False),  # NaN
    ("0.1", False),  # text is not a number here (the CLI converts it first)
    (True, False),  # a bool is not a temperature
]


@pytest.mark.parametrize("tau, valid", TAU_CASES)
def test_tau_must_be_finite_and_positive(tau, valid):
    if valid:
        assert cr.check_tau(tau) == float(tau)
    else:
        with pytest.raises(ValueError, match="tau must be a finite number > 0"):
            cr.check_tau(tau)


def write_q_csv(path: Path, q_rows: list[list[str]]) -> Path:
    lines = ["timestep,prompt,q_action_0,q_action_1,q_action_2,q_action_3,series"]
    for index, row in enumerate(q_rows):
        lines.append(f"{8 + index},\"system:\nhi, there\n\nuser:\nq?\",{','.join(row)},w")
    path.write_text("\n".join(lines) + "\n")
    return path


GOOD = [["-1.000000", "-1.100000", "-1.200000", "-1.300000"], ["0.5", "0.5", "0.25", "-2"]]

# ---- bad Q cells: (data row 0-based, column index, text, expected message) --------------------------------
BAD_Q_CASES = [
    (0, 2, "", "row 1, column 'q_action_2': missing Q-value"),  # empty cell
    (1, 0, "abc", "row 2, column 'q_action_0', value 'abc': Q-value is not a number"),  # non-numeric
    (1, 3, "nan", "row 2, column 'q_action_3', value 'nan': Q-value is not finite"),  # NaN
    (0, 1, "inf", "row 1, column 'q_action_1', value 'inf': Q-value is not finite"),  # infinite
    (1, 1, "-Infinity", "row 2, column 'q_action_1', value '-Infinity': Q-value is not finite"),  # -inf spelled out
]


@pytest.mark.parametrize("row, column, text, message", BAD_Q_CASES)
def test_bad_q_cells_name_file_row_column_and_nothing_is_written(tmp_path, row, column, text, message):
    rows = [list(r) for r in GOOD]
    rows[row][column] = text
    bad = write_q_csv(tmp_path / "bad_q_dataset.csv", rows)
    good = write_q_csv(tmp_path / "good_q_dataset.csv", GOOD)
    before = {p: p.read_bytes() for p in (bad, good)}
    with pytest.raises(InputError) as info:
        cr.calculate_rewards([tmp_path], 0.05, overwrite=True)
    assert f"{bad}, {message}" in str(info.value)
    assert {p: p.read_bytes() for p in (bad, good)} == before  # neither file was touched
    assert sorted(p.name for p in tmp_path.iterdir()) == ["bad_q_dataset.csv", "good_q_dataset.csv"]


def test_missing_q_column_is_an_error(tmp_path):
    path = tmp_path / "x.csv"
    path.write_text("prompt,q_action_0,q_action_1,q_action_2\na,1,2,3\n")
    with pytest.raises(InputError, match="missing column"):
        cr.calculate_rewards([path], 0.05, overwrite=False)


def test_sibling_output_keeps_other_columns_and_inserts_rewards_after_q(tmp_path):
    source = write_q_csv(tmp_path / "a_q_dataset.csv", GOOD)
    before = source.read_bytes()
    [written] = cr.calculate_rewards([source], 0.5, overwrite=False)
    assert written == tmp_path / "a_q_dataset_with_reward.csv"
    assert source.read_bytes() == before
    out = pd.read_csv(written, dtype=str, keep_default_na=False)
    original = pd.read_csv(source, dtype=str, keep_default_na=False)
    assert list(out.columns) == ["timestep", "prompt", *tes_env.Q_COLUMNS, *tes_env.REWARD_COLUMNS, "series"]
    assert out[original.columns].equals(original)  # every other cell is the same text ("-1.000000" stays)
    for index, q in enumerate(GOOD):
        rewards = [float(out.loc[index, c]) for c in list(tes_env.REWARD_COLUMNS)]
        assert rewards == pytest.approx(cr.boltzmann([float(v) for v in q], 0.5), abs=1e-15)
        assert math.fsum(rewards) == pytest.approx(1.0, abs=1e-12)


def test_overwrite_replaces_in_place_and_recomputes_existing_rewards(tmp_path):
    source = write_q_csv(tmp_path / "b_q_dataset.csv", GOOD)
    cr.calculate_rewards([source], 0.05, overwrite=True)
    first = pd.read_csv(source)
    cr.calculate_rewards([source], 1.0, overwrite=True)  # the reward columns are replaced, not duplicated
    second = pd.read_csv(source)
    assert list(second.columns) == list(first.columns)
    assert second.reward_action_0[0] == pytest.approx(cr.boltzmann([-1.0, -1.1, -1.2, -1.3], 1.0)[0])
    assert [p.name for p in tmp_path.iterdir()] == ["b_q_dataset.csv"]  # no temporary left behind


def test_folders_take_q_csvs_recursively_and_skip_others(tmp_path):
    (tmp_path / "train").mkdir()
    write_q_csv(tmp_path / "train" / "x_q_dataset.csv", GOOD)
    (tmp_path / "series").mkdir()
    (tmp_path / "series" / "s.csv").write_text("datetime,co2_kg_per_kwh,cooling_load_kw\n")
    write_q_csv(tmp_path / "old_with_reward.csv", GOOD)
    files, skipped = cr.expand_paths([tmp_path])
    assert files == [tmp_path / "train" / "x_q_dataset.csv"]
    assert sorted(skipped) == [tmp_path / "old_with_reward.csv", tmp_path / "series" / "s.csv"]


# ---- command line: (arguments, exit code, text in stderr) ---------------------------------------------------
CLI_CASES = [
    (["--tau", "0"], 2, "--TAU=0.0: must be a finite number > 0"),  # tau 0
    (["--tau", "nan"], 2, "--TAU='nan': not a valid float (must be a finite number)"),  # tau NaN
    (["--tau", "abc"], 2, "not a valid float"),  # tau not a number
    (["--tau", "0.05", "--overwrite"], 0, ""),  # fine
    (["--tau", "0.05", "--overwrite", "yes"], 0, ""),  # a bool word after the flag is its value
]


@pytest.mark.parametrize("args, code, message", CLI_CASES)
def test_cli(tmp_path, args, code, message):
    source = write_q_csv(tmp_path / "c_q_dataset.csv", GOOD)
    result = subprocess.run([sys.executable, str(REPO / "calculate_reward.py"), str(tmp_path), *args], cwd=REPO,
                            capture_output=True, text=True)
    assert result.returncode == code, result.stderr
    assert message in result.stderr
    assert ("reward_action_0" in source.read_text()) == (code == 0)


def test_no_path_reads_the_data_folder_and_leaves_it_as_it_is(tmp_path):
    """`python calculate_reward.py` alone takes data/ (of the working folder), like check_data.py, and writes its
    copies under runs/rewards/: the shipped data/ stays as make_example_data.py --CHECK compares it."""
    (tmp_path / "data" / "train").mkdir(parents=True)
    source = write_q_csv(tmp_path / "data" / "train" / "x_q_dataset.csv", GOOD)
    elsewhere = write_q_csv(tmp_path / "other_q_dataset.csv", GOOD)  # outside data/: not touched
    before = sorted(p.relative_to(tmp_path) for p in tmp_path.rglob("*"))
    result = subprocess.run([sys.executable, str(REPO / "calculate_reward.py")], cwd=tmp_path, capture_output=True,
                            text=True)
    assert result.returncode == 0, result.stderr
    written = Path("runs/rewards/data/train/x_q_dataset_with_reward.csv")
    assert result.stdout.splitlines() == [f"wrote {written} (tau=0.05)"]
    assert "reward_action_0" in (tmp_path / written).read_text()
    assert "reward_action_0" not in source.read_text() + elsewhere.read_text()
    after = sorted(p.relative_to(tmp_path) for p in tmp_path.rglob("*") if not p.is_relative_to(tmp_path / "runs"))
    assert after == before  # nothing new in data/ or beside it


# (input path, OUT_DIR, --OVERWRITE, where the output goes; {cwd}: the working folder)
OUTPUT_PATHS = [
    ("data/train/x.csv", "runs/rewards", False, "runs/rewards/data/train/x_with_reward.csv"),  # the default
    ("{cwd}/data/x.csv", "runs/rewards", False, "runs/rewards/data/x_with_reward.csv"),  # absolute, inside cwd
    ("/elsewhere/q/x.csv", "runs/rewards", False, "runs/rewards/elsewhere/q/x_with_reward.csv"),  # outside cwd
    ("../up/x.csv", "out", False, "out/{parent}/up/x_with_reward.csv"),  # never above OUT_DIR
    ("data/x.csv", "", False, "data/x_with_reward.csv"),  # OUT_DIR="": beside the input
    ("data/x.csv", "runs/rewards", True, "data/x.csv"),  # --OVERWRITE: the input itself
]


@pytest.mark.parametrize("path, out_dir, overwrite, expected", OUTPUT_PATHS)
def test_reward_output_path(tmp_path, monkeypatch, path, out_dir, overwrite, expected):
    cwd = tmp_path / "work"
    cwd.mkdir()
    monkeypatch.chdir(cwd)
    parent = str(tmp_path.relative_to(tmp_path.anchor))
    got = cr.reward_output_path(Path(path.format(cwd=cwd)), overwrite, out_dir)
    assert got == Path(expected.format(parent=parent))


def test_main_twice_in_one_process_keeps_the_defaults(tmp_path, capsys):
    source = write_q_csv(tmp_path / "d_q_dataset.csv", GOOD)
    assert cr.main([str(source), "--TAU=1", "--OVERWRITE"]) == 0
    assert cr.TAU == 0.05 and cr.OVERWRITE is False and cr.PATHS == ["data"]  # the module's constants are untouched
    assert cr.main([str(source), "--OVERWRITE"]) == 0
    second = pd.read_csv(source)
    assert second.reward_action_0[0] == pytest.approx(cr.boltzmann([-1.0, -1.1, -1.2, -1.3], 0.05)[0])
    assert "tau=1" in capsys.readouterr().out
