"""Boltzmann-softmax rewards from Q-values: reward_action_k = softmax(q_action_0..3 / tau)_k.

    python calculate_reward.py                              # every Q table under data/ -> runs/rewards/data/...
    python calculate_reward.py data --TAU=0.05 --OVERWRITE  # the same, replacing the files themselves
    python calculate_reward.py data --OUT_DIR=              # X_with_reward.csv beside each X.csv

PATHS may be files or folders (default: data). A folder means every CSV below it (recursively) whose header has
the columns q_action_0..3, except `*_with_reward.csv` outputs of an earlier run. Without --OVERWRITE each
FILE.csv gets a FILE_with_reward.csv under OUT_DIR, at the input's path from the working folder
(data/train/x.csv -> runs/rewards/data/train/x_with_reward.csv), so that the shipped data/ stays as it is
(make_example_data.py --CHECK compares it); OUT_DIR="" puts it beside the input. An existing output is refused.
With --OVERWRITE the file itself is replaced atomically (a symlink's target is replaced, the link stays). The
reward columns are inserted after q_action_3 (replaced in place if present); every other cell is kept as the same
text (read as strings, never reformatted). TAU must be finite and > 0.
Missing, non-numeric, NaN or infinite Q-values, duplicate column names and text that is not UTF-8 are errors
that name the file, row (1 = first data row) and column; every file is checked before anything is written, and
the files are written all or none (a failed write restores the ones already replaced).
Exit status: 0 done, 1 bad input file or failed write, 2 bad setting.
"""

from __future__ import annotations

import math
import os
import sys
from pathlib import Path
from typing import Sequence

from tes_grpo.run.fileio import (
    InputError,
    csv_files,
    csv_writer,
    parse_finite,
    read_csv_header,
    read_csv_table,
    write_files_atomic,
)
from tes_grpo.task import tes_env

PATHS: list = ["data"]  # CSV files or folders (positional arguments)
TAU = 0.05  # softmax temperature in Q units; must be finite and > 0
OVERWRITE = False  # replace the input files instead of writing *_with_reward.csv copies
OUT_DIR = "runs/rewards"  # where the *_with_reward.csv copies go (at each input's path); "" = beside each input

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
    return read_csv_table(path)


def with_rewards(frame, tau: float, path) -> object:
    """A copy of `frame` with reward_action_0..3 after q_action_3; InputError on a bad Q cell."""
    missing = [c for c in _Q_COLUMNS if c not in frame.columns]
    if missing:
        raise InputError(path, f"missing column(s) {', '.join(missing)}")
    if len(frame) == 0:
        raise InputError(path, "no data rows")
    rewards = {column: [] for column in _REWARD_COLUMNS}
    for index, cells in enumerate(frame[_Q_COLUMNS].itertuples(index=False, name=None)):
        q = [parse_q(path, index + 1, column, cell) for column, cell in zip(_Q_COLUMNS, cells, strict=True)]
        for column, value in zip(_REWARD_COLUMNS, boltzmann(q, tau), strict=True):
            rewards[column].append(format_reward(value))
    out = frame.drop(columns=[c for c in _REWARD_COLUMNS if c in frame.columns])
    position = list(out.columns).index(_Q_COLUMNS[-1]) + 1
    for offset, column in enumerate(_REWARD_COLUMNS):
        out.insert(position + offset, column, rewards[column])
    return out


def reward_output_path(path: Path, overwrite: bool, out_dir: str | os.PathLike = "") -> Path:
    """The input itself (overwrite), else X_with_reward.csv: beside it, or under out_dir at the input's path from
    the working folder (from the filesystem's root for an input outside it: never above out_dir)."""
    if overwrite:
        return path
    named = path.with_name(f"{path.stem}{_WITH_REWARD_SUFFIX}{path.suffix}")
    if not str(out_dir):
        return named
    absolute = Path(os.path.abspath(named))
    try:
        inner = absolute.relative_to(Path.cwd())
    except ValueError:
        inner = absolute.relative_to(absolute.anchor)
    return Path(out_dir) / inner


def is_q_table(path: Path) -> bool:
    """A CSV found in a folder is processed when it has the Q columns and is not an earlier output."""
    return not path.stem.endswith(_WITH_REWARD_SUFFIX) and all(c in read_csv_header(path) for c in _Q_COLUMNS)


def expand_paths(paths: Sequence) -> tuple[list[Path], list[Path]]:
    """(files to process, CSVs skipped in folders for lacking Q columns or being earlier outputs)."""
    return csv_files(paths, wanted=is_q_table)


def calculate_rewards(paths: Sequence, tau: float, overwrite: bool, out_dir: str | os.PathLike = "") -> list[Path]:
    """Checks every file, then writes them all (or none); raises InputError, nothing written, on the first error.
    out_dir: where the copies go (reward_output_path); "" beside their inputs."""
    tau = check_tau(tau)
    files, _ = expand_paths(paths)
    if not files:
        raise InputError(", ".join(str(p) for p in paths) or "<no paths>", "no CSV with q_action_0..3 columns")
    targets = [reward_output_path(path, overwrite, out_dir) for path in files]
    if not overwrite:
        existing = [target for target in targets if target.exists() or target.is_symlink()]
        if existing:
            raise InputError(existing[0], f"output exists ({len(existing)} in all); pass --OVERWRITE to replace "
                                          "the inputs themselves, or move it away")
    frames = [with_rewards(read_table(path), tau, path) for path in files]
    outputs = [(target, csv_writer(frame)) for target, frame in zip(targets, frames, strict=True)]
    return write_files_atomic(outputs, suffix=".csv")


def main(argv: list[str] | None = None) -> int:
    from tes_grpo.run.script_config import resolve

    settings = resolve(globals(), argv, positional="PATHS")
    try:
        check_tau(settings.TAU)
    except ValueError:
        print(f"error: --TAU={settings.TAU!r}: must be a finite number > 0", file=sys.stderr)
        return 2
    try:
        files, skipped = expand_paths(settings.PATHS)
        for path in skipped:
            print(f"skipped {path} (no q_action_0..3 columns, or an earlier {_WITH_REWARD_SUFFIX} output)")
        written = calculate_rewards(files if files else settings.PATHS, settings.TAU, settings.OVERWRITE,
                                    settings.OUT_DIR)
    except InputError as err:
        print(f"error: {err}", file=sys.stderr)
        return 1
    for path in written:
        print(f"wrote {path} (tau={settings.TAU:g})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
