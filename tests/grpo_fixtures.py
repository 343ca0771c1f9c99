"""Training-data fixtures for the GRPO tests: real TES prompts in Harmony, prompt-specific rewards.

The prompts are the task's own (task_prompt.build_prompt on a fixed synthetic series), rendered to Harmony by the
gpt-oss chat template exactly as the datasets are (harmony.render_harmony_prompt). Each prompt has its
own reward row and its own optimal action, so a completion scored with another prompt's rewards shows up as a
wrong reward in the completion log. Action 1 is also good on average (mean reward 0.51 against 0.16 for the
others), so a policy that only learns the better action overall already raises the mean reward; learning each
prompt's own best action raises it further (0.59 at best).
"""

from __future__ import annotations

from datetime import datetime, timedelta
from pathlib import Path

import pandas as pd

# (timestep, TES energy kWh, reward_action_0..3); the optimal action is the argmax and differs per prompt.
TRAIN_ROWS = [
    (8, 150.0, [0.50, 0.40, 0.05, 0.05]),
    (12, 40.0, [0.05, 0.85, 0.05, 0.05]),
    (33, 280.0, [0.05, 0.40, 0.50, 0.05]),
    (57, 210.0, [0.05, 0.40, 0.05, 0.50]),
]
EVAL_ROWS = [(14, 90.0, [0.97, 0.01, 0.01, 0.01])]  # must never reach training


def fixture_series():
    """A fixed 4-day tes_env.Series: CO2 factors with a daily dip, cooling load in business hours."""
    import math

    from tes_grpo.task import tes_env
    start = datetime(2024, 7, 1)
    hours = range(tes_env.SERIES_HOURS)
    co2 = tuple(round(0.40 + 0.07 * math.cos(2 * math.pi * (h % 24 - 13) / 24) + 0.01 * (h // 24), 3) for h in hours)
    load = tuple(round(20 + 25 * math.sin(math.pi * (h % 24 - 7) / 11), 1)
                 if tes_env.FIRST_BUSINESS_HOUR <= h % 24 <= tes_env.LAST_BUSINESS_HOUR else 0.0 for h in hours)
    return tes_env.Series(name="fixture", datetimes=tuple(start + timedelta(hours=h) for h in hours), co2=co2,
                          load=load)


def harmony_prompt(tokenizer, timestep: int, energy: float, reasoning_effort: str = "medium") -> str:
    from tes_grpo.task import task_prompt
    from tes_grpo.task.harmony import render_harmony_prompt

    system, user = task_prompt.build_prompt(fixture_series(), timestep, energy)
    return render_harmony_prompt(system, user, tokenizer, reasoning_effort)


def fixture_frame(tokenizer, rows) -> pd.DataFrame:
    records = []
    for timestep, energy, rewards in rows:
        record = {"timestep": timestep, "timestamp": f"t{timestep}",
                  "prompt": harmony_prompt(tokenizer, timestep, energy),
                  "optimal_action": max(range(4), key=lambda k: rewards[k])}
        record.update({f"q_action_{k}": round(-10 + r, 3) for k, r in enumerate(rewards)})
        record.update({f"reward_action_{k}": r for k, r in enumerate(rewards)})
        records.append(record)
    return pd.DataFrame(records)


def write_fixture_data(root: Path, tokenizer) -> Path:
    """root/data: two training files (2 prompts each), one eval file, one legacy (non-Harmony) file to ignore."""
    data = Path(root) / "data"
    (data / "train").mkdir(parents=True, exist_ok=True)
    (data / "eval").mkdir(parents=True, exist_ok=True)
    train = fixture_frame(tokenizer, TRAIN_ROWS)
    train.iloc[:2].to_csv(data / "train" / "w1_q_dataset_harmony.csv", index=False)
    train.iloc[2:].to_csv(data / "train" / "w2_q_dataset_harmony.csv", index=False)
    legacy = train.iloc[:1].copy()
    legacy["prompt"] = "system:\nlegacy text\n\nuser:\nnot for training"
    legacy.to_csv(data / "train" / "w1_q_dataset.csv", index=False)
    fixture_frame(tokenizer, EVAL_ROWS).to_csv(data / "eval" / "w9_q_dataset_harmony.csv", index=False)
    return data


def rewards_by_prompt(tokenizer, reasoning_effort: str) -> dict[str, tuple[list[float], int]]:
    """prompt text as training sees it (reasoning effort applied) -> (its rewards, its optimal action)."""
    from tes_grpo.task.harmony import set_reasoning_effort

    return {set_reasoning_effort(harmony_prompt(tokenizer, t, e), reasoning_effort):
            (r, max(range(4), key=r.__getitem__))
            for t, e, r in TRAIN_ROWS}
