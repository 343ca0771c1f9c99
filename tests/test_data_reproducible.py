"""data/ is exactly what `python make_example_data.py` writes, and passes check_data.py."""

from __future__ import annotations

from pathlib import Path

import pandas as pd
import pytest

import check_data
import make_example_data
from tes_grpo.task import tes_env

DATA = Path(__file__).resolve().parents[1] / "data"


def test_regeneration_reproduces_data_byte_for_byte(tmp_path):
    written, table = make_example_data.make_example_data(tmp_path, progress=False)
    assert len(written) == 36 and len(table) == 12
    assert make_example_data.compare_trees(DATA, tmp_path) == []


def test_shipped_data_passes_the_checker_and_the_split_contract():
    files, rows, problems = check_data.check_paths([DATA])
    assert problems == []
    assert (files, rows) == (12, 360)
    assert len(list((DATA / "train").glob("*_harmony.csv"))) == 9
    assert len(list((DATA / "eval").glob("*_harmony.csv"))) == 3
    for path in sorted((DATA / "series").glob("*.csv")):
        series = tes_env.load_series(path)  # validates columns, 96 hourly rows, zero night load
        assert list(pd.read_csv(path).columns) == ["datetime", "co2_kg_per_kwh", "cooling_load_kw"]
        business = [series.load[t] for t in range(96) if tes_env.is_business_hour(t)]
        assert 0.18 <= min(series.co2) and max(series.co2) <= 0.56
        assert 20.0 <= sum(business) / len(business) <= 40.0


def test_shipped_rewards_are_the_tau_005_softmax_of_q():
    import calculate_reward

    frame = pd.read_csv(DATA / "train" / "tes_2024-06-03_q_dataset_harmony.csv")
    for row in frame.itertuples():
        q = [getattr(row, f"q_action_{a}") for a in range(4)]
        rewards = [getattr(row, f"reward_action_{a}") for a in range(4)]
        assert rewards == pytest.approx(calculate_reward.boltzmann(q, 0.05), abs=1e-15)
