"""make_q_dataset.py: rows of the optimal trajectory with exact Q, off-trajectory states, CLI and its errors."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pandas as pd
import pytest

import make_q_dataset
import make_series
from tes_grpo.task import task_prompt, tes_env, tes_policies

REPO = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def series_file(tmp_path_factory) -> Path:
    folder = tmp_path_factory.mktemp("series")
    windows = make_series.generate_windows(n_windows=2, seed=7, start_date="2024-07-01")
    return make_series.write_windows(folder, windows, overwrite=False)[0]


def run_script(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, str(REPO / "make_q_dataset.py"), *args], cwd=REPO,
                          capture_output=True, text=True)


def test_rows_follow_the_optimal_trajectory_with_exact_q(series_file):
    series = tes_env.load_series(series_file)
    solver = tes_env.QSolver(series)
    frame = pd.DataFrame(make_q_dataset.dataset_rows(series, solver=solver))
    assert list(frame.columns) == list(tes_env.DATASET_COLUMNS)
    assert [int(t) for t in frame.timestep] == tes_env.business_timesteps()
    assert frame.timestamp.iloc[0] == "2024-07-01T08:00:00" and frame.timestamp.iloc[-1] == "2024-07-03T17:00:00"
    energy = 150.0
    for t, row in zip(tes_env.business_timesteps(), frame.itertuples(), strict=True):
        assert float(row.tes_energy_kwh) == pytest.approx(energy, abs=1e-6)
        q = [float(getattr(row, f"q_action_{a}")) for a in range(4)]
        assert q == pytest.approx(solver.q_values(t, energy), abs=5e-7)  # 6 decimals
        action = int(row.optimal_action)
        assert q[action] == pytest.approx(max(q), abs=1e-6)
        system, user = task_prompt.parse_legacy_prompt(row.prompt)
        assert (system, user) == task_prompt.build_prompt(series, t, energy)
        energy = tes_env.step(series, t, energy, action).energy
        for night in range(t + 1, t + 24):
            if tes_env.is_business_hour(night) or night >= 72:
                break
            energy = tes_env.step(series, night, energy, 0).energy
    assert set(frame.on_trajectory) == {"1"} and set(frame.series) == {series.name}
    # the optimal rollout's return is V_0(150)
    optimal = tes_policies.simulate(series, tes_policies.OptimalPolicy(series))
    assert optimal.total_reward == pytest.approx(solver.value(0, 150.0))


def test_off_trajectory_states_add_rows_at_the_same_hours(series_file):
    series = tes_env.load_series(series_file)
    solver = tes_env.QSolver(series)
    rows = make_q_dataset.dataset_rows(series, extra_energies=[0.0, 300.0], random_per_hour=2, seed=1, solver=solver)
    frame = pd.DataFrame(rows)
    on = frame[frame.on_trajectory == "1"]
    off = frame[frame.on_trajectory == "0"]
    assert len(on) == 30
    assert 30 * 4 - 2 <= len(off) <= 30 * 4  # a fixed energy equal to the trajectory's adds no row
    assert set(off.timestep) == set(on.timestep)
    for row in off.itertuples():
        t, energy = int(row.timestep), float(row.tes_energy_kwh)
        assert [float(getattr(row, f"q_action_{a}")) for a in range(4)] == pytest.approx(
            solver.q_values(t, energy), abs=5e-6)  # energies are written to 6 decimals too
        assert f"TES energy now: {energy:.1f} kWh" in row.prompt
    again = pd.DataFrame(make_q_dataset.dataset_rows(series, extra_energies=[0.0, 300.0], random_per_hour=2, seed=1))
    assert again.equals(frame)  # seeded


def test_cli_writes_dataset_and_prints_policy_table(series_file, tmp_path):
    out = tmp_path / "out"
    result = run_script(str(series_file), "--out-dir", str(out), "--initial-energy", "100",
                        "--RANDOM_POLICY_RUNS=2")
    assert result.returncode == 0, result.stderr
    target = out / f"{series_file.stem}_q_dataset.csv"
    frame = pd.read_csv(target)
    assert len(frame) == 30 and frame.tes_energy_kwh.iloc[0] == 100.0
    assert "optimal" in result.stdout and "storage_first" in result.stdout and series_file.stem in result.stdout
    # the optimum's net CO2 in the table is -6 * V_0(100)
    series = tes_env.load_series(series_file)
    v0 = tes_env.QSolver(series).value(0, 100.0)
    line = next(text for text in result.stdout.splitlines() if text.startswith(series_file.stem))
    assert float(line.split()[1]) == pytest.approx(-6 * v0, abs=0.006)
    # a second run refuses to overwrite, --overwrite replaces it with the same bytes
    before = target.read_bytes()
    refused = run_script(str(series_file), "--out-dir", str(out), "--initial-energy", "100")
    assert refused.returncode == 1 and "pass --OVERWRITE" in refused.stderr
    assert run_script(str(series_file), "--out-dir", str(out), "--initial-energy", "100", "--overwrite").returncode == 0
    assert target.read_bytes() == before


def test_cli_bad_series_names_the_cell_and_writes_nothing(series_file, tmp_path):
    lines = series_file.read_text().splitlines()
    lines[13] = lines[13].rsplit(",", 1)[0] + ",lots"  # data row 13 (12:00 of day 1), load column
    bad = tmp_path / "bad.csv"
    bad.write_text("\n".join(lines) + "\n")
    out = tmp_path / "out"
    result = run_script(str(series_file), str(bad), "--out-dir", str(out))
    assert result.returncode == 1
    assert f"{bad}, row 13, column 'cooling_load_kw', value 'lots': not a number" in result.stderr
    assert not out.exists() or not any(out.iterdir())  # the good file is not written either


def test_off_trajectory_energy_list_is_validated():
    assert make_q_dataset.parse_energy_list("0, 150,300") == [0.0, 150.0, 300.0]
    assert make_q_dataset.parse_energy_list("") == []
    with pytest.raises(ValueError, match="outside"):
        make_q_dataset.parse_energy_list("301")
    with pytest.raises(ValueError, match=r"--OFF_TRAJECTORY_ENERGIES='0,x': 'x' is not a number"):
        make_q_dataset.parse_energy_list("0,x")


def test_policy_table_lists_every_series_and_the_saving():
    table = {"a": {"optimal": 40.0, "follow_load": 90.0, "storage_first": 50.0},
             "b": {"optimal": 30.0, "follow_load": 60.0, "storage_first": 40.0}}
    text = make_q_dataset.format_policy_table(table)
    lines = text.splitlines()
    assert lines[2].split()[:4] == ["a", "40.00", "90.00", "50.00"] and lines[2].endswith("20.0% less")
    assert lines[3].endswith("25.0% less")
    assert lines[5].split()[:4] == ["total", "70.00", "150.00", "90.00"]
