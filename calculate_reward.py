"""Boltzmann-softmax rewards from Q-values: reward_action_k = softmax(q_action_0..3 / tau)_k.

    python calculate_reward.py data --tau 0.05 --overwrite

PATHS may be files or folders. A folder means every CSV below it (recursively) whose header has the
columns q_action_0..3, except `*_with_reward.csv` outputs of an earlier run. Without --overwrite each
FILE.csv gets a sibling FILE_with_reward.csv; with --overwrite the file itself is replaced atomically.
The reward columns are inserted after q_action_3 (replaced in place if present); every other cell is
kept as the same text (read as strings, never reformatted). tau must be finite and > 0.
Missing, non-numeric, NaN or infinite Q-values are errors that name the file, row (1 = first data
row) and column; every file is checked before anything is written, so nothing is written if any file
has an error.
"""

from __future__ import annotations

import math
import sys
from pathlib import Path
from typing import Sequence

from tes_grpo import tes_env
from tes_grpo.fileio import InputError, parse_finite, write_csv_atomic

PATHS: list = []  # CSV files or folders (positional arguments)
TAU = 0.05  # softmax temperature in Q units; must be finite and > 0
OVERWRITE = False  # replace the input files instead of writing *_with_reward.csv siblings

_WITH_REWARD_SUFFIX = "_with_reward"
_Q_COLUMNS = list(tes_env.Q_COLUMNS)
_REWARD_COLUMNS = list(tes_env.REWARD_COLUMNS)


def check_tau(tau) -> float:
    if isinstance(tau, bool) or not isinstance(tau, (int, float)) or not math.isfinite(tau) or tau <= 0:
        raise ValueError(f"tau must be a finite number > 0, got {tau!r}")
    return float(tau)


def boltzmann(q_values: Sequence[float], tau: float) -> list[float]:
    """softmax(q / tau), stable for any finite q and tau > 0 (the largest term is exp(0) = 1)."""
    tau = check_tau(tau)
    top = max(q_values)
    weights = [math.exp((q - top) / tau) for q in q_values]
    total = math.fsum(weights)
    return [w / total for w in weights]


def format_reward(value: float) -> str:
    # repr is the shortest text that reads back as the same float, so sums to 1 survive the CSV
    return repr(float(value))


def parse_q(path, row: int, column: str, text) -> float:
    return parse_finite(path, row, column, text, what="Q-value")


def read_table(path: Path):
    """The CSV as a DataFrame of strings (nothing reformatted; empty cells stay empty strings)."""
    import pandas as pd

    try:
        return pd.read_csv(path, dtype=str, keep_default_na=False, na_filter=False)
    except (OSError, pd.errors.ParserError, pd.errors.EmptyDataError, UnicodeDecodeError) as err:
        raise InputError(path, f"cannot read as CSV: {err}") from None


def with_rewards(frame, tau: float, path) -> object:
    """A copy of `frame` with reward_action_0..3 after q_action_3; InputError on a bad Q cell."""
    missing = [c for c in _Q_COLUMNS if c not in frame.columns]
    if missing:
        raise InputError(path, f"missing column(s) {', '.join(missing)}")
    if len(frame) == 0:
        raise InputError(path, "no data rows")
    rewards = {column: [] for column in _REWARD_COLUMNS}
    for index, cells in enumerate(frame[_Q_COLUMNS].itertuples(index=False, name=None)):
        q = [parse_q(path, index + 1, column, cell) for column, cell in zip(_Q_COLUMNS, cells)]
        for column, value in zip(_REWARD_COLUMNS, boltzmann(q, tau)):
            rewards[column].append(format_reward(value))
    out = frame.drop(columns=[c for c in _REWARD_COLUMNS if c in frame.columns])
    position = list(out.columns).index(_Q_COLUMNS[-1]) + 1
    for offset, column in enumerate(_REWARD_COLUMNS):
        out.insert(position + offset, column, rewards[column])
    return out


def reward_output_path(path: Path, overwrite: bool) -> Path:
    return path if overwrite else path.with_name(f"{path.stem}{_WITH_REWARD_SUFFIX}{path.suffix}")


def has_q_columns(path: Path) -> bool:
    import csv

    with path.open(newline="", encoding="utf-8") as handle:
        header = next(csv.reader(handle), [])
    return all(column in header for column in _Q_COLUMNS)


def expand_paths(paths: Sequence) -> tuple[list[Path], list[Path]]:
    """(files to process, CSVs skipped in folders for lacking Q columns or being earlier outputs)."""
    files, skipped = [], []
    for raw in paths:
        path = Path(raw)
        if path.is_dir():
            for candidate in sorted(path.rglob("*.csv")):
                if candidate.stem.endswith(_WITH_REWARD_SUFFIX) or not has_q_columns(candidate):
                    skipped.append(candidate)
                else:
                    files.append(candidate)
        elif path.is_file():
            files.append(path)
        else:
            raise InputError(path, "no such file or folder")
    return files, skipped


def calculate_rewards(paths: Sequence, tau: float, overwrite: bool) -> list[Path]:
    """Checks every file, then writes them all; raises InputError (nothing written) on the first bad cell."""
    tau = check_tau(tau)
    files, _ = expand_paths(paths)
    if not files:
        raise InputError(", ".join(str(p) for p in paths) or "<no paths>", "no CSV with q_action_0..3 columns")
    prepared = [(reward_output_path(path, overwrite), with_rewards(read_table(path), tau, path)) for path in files]
    return [write_csv_atomic(frame, target) for target, frame in prepared]


def main() -> None:
    from tes_grpo.script_config import configure

    configure(globals(), positional="PATHS")
    try:
        files, skipped = expand_paths(PATHS)
        for path in skipped:
            print(f"skipped {path} (no q_action_0..3 columns, or an earlier {_WITH_REWARD_SUFFIX} output)")
        written = calculate_rewards([str(p) for p in files] if files else PATHS, TAU, OVERWRITE)
    except (InputError, ValueError) as err:
        print(f"error: {err}", file=sys.stderr)
        sys.exit(1)
    for path in written:
        print(f"wrote {path} (tau={TAU:g})")


if __name__ == "__main__":
    main()
