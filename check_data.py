"""Checks the CSVs that training and evaluation read; lists every problem and exits 1 if there is any.

    python check_data.py [data ...]

A folder means every *_harmony.csv below it (training reads data/**/*_harmony.csv outside data/eval/;
evaluation reads those under data/eval/); a file is checked whatever its name. Each file must be UTF-8 (a
byte-order mark is fine) with unique column names, the columns
timestep,timestamp,prompt,optimal_action,q_action_0..3,reward_action_0..3 and at least one row; each row
needs a prompt in Harmony format (starts with <|start|>, ends with the generation prompt
<|start|>assistant), four finite Q-values, four finite rewards in [0, 1] summing to 1 (within SUM_TOLERANCE),
and an optimal_action in 0..3 that is an argmax of the Q-values (within ARGMAX_TOLERANCE).
Exit status: 0 no problem, 1 problems (listed on stdout), 2 bad setting.
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Sequence

from tes_grpo.run.fileio import InputError, csv_files, parse_finite, parse_whole, read_csv_table
from tes_grpo.task import tes_env
from tes_grpo.task.harmony import prompt_problem

PATHS: list = ["data"]  # files or folders to check (positional arguments)
SUM_TOLERANCE = tes_env.REWARD_SUM_TOLERANCE  # allowed |sum of rewards - 1| (0..0.01); training uses this default
ARGMAX_TOLERANCE = 1e-6  # optimal_action's Q may be this far below the row's max Q (6-decimal rounding; 0..0.1)

_MAX_SUM_TOLERANCE = 0.01  # looser and the sum check no longer tells a softmax from arbitrary numbers
_MAX_ARGMAX_TOLERANCE = 0.1  # Q gaps between actions are often ~0.01-0.3; looser accepts wrong labels
_N_ACTIONS = tes_env.N_ACTIONS
_Q_COLUMNS = list(tes_env.Q_COLUMNS)
_REWARD_COLUMNS = list(tes_env.REWARD_COLUMNS)
_REQUIRED_COLUMNS = ["timestep", "timestamp", "prompt", "optimal_action", *_Q_COLUMNS, *_REWARD_COLUMNS]


def problem(path, message: str, row: int | None = None, column: str | None = None) -> str:
    return str(InputError(path, message, row=row, column=column))


def cell(parse, problems: list[str], *args, **kwargs):
    """parse(*args, **kwargs) (fileio's parse_finite / parse_whole), or None with its problem listed."""
    try:
        return parse(*args, **kwargs)
    except InputError as err:
        problems.append(str(err))
        return None


def check_row(path, row: int, cells: dict, problems: list[str], sum_tolerance: float = SUM_TOLERANCE,
              argmax_tolerance: float = ARGMAX_TOLERANCE) -> None:
    prompt_is_not = prompt_problem(cells["prompt"])  # the rule training and evaluation apply
    if prompt_is_not:
        problems.append(problem(path, prompt_is_not, row, "prompt"))
    cell(parse_whole, problems, path, row, "timestep", cells["timestep"], what="timestep")
    q = [cell(parse_finite, problems, path, row, c, cells[c], what="Q-value") for c in _Q_COLUMNS]
    rewards = [cell(parse_finite, problems, path, row, c, cells[c], what="reward") for c in _REWARD_COLUMNS]
    if all(value is not None for value in rewards):
        for action, why in tes_env.reward_problems(rewards, sum_tolerance):
            column = "reward_action_0..3" if action is None else _REWARD_COLUMNS[action]
            problems.append(problem(path, why, row, column))
    action = cell(parse_whole, problems, path, row, "optimal_action", cells["optimal_action"], 0, _N_ACTIONS - 1,
                  what="optimal_action")
    if action is not None and all(value is not None for value in q) and q[action] < max(q) - argmax_tolerance:
        problems.append(problem(path, f"action {action} is not an argmax of the Q-values", row, "optimal_action"))


def check_file(path: Path, sum_tolerance: float = SUM_TOLERANCE,
               argmax_tolerance: float = ARGMAX_TOLERANCE) -> tuple[int, list[str]]:
    """(rows checked, problems) for one CSV."""
    try:
        frame = read_csv_table(path)
    except InputError as err:
        return 0, [str(err)]
    missing = [c for c in _REQUIRED_COLUMNS if c not in frame.columns]
    if missing:
        return 0, [problem(path, f"missing column(s) {', '.join(missing)}")]
    if len(frame) == 0:
        return 0, [problem(path, "no data rows")]
    problems: list[str] = []
    for index, cells in enumerate(frame[_REQUIRED_COLUMNS].to_dict("records")):
        check_row(path, index + 1, cells, problems, sum_tolerance, argmax_tolerance)
    return len(frame), problems


def files_to_check(paths: Sequence) -> tuple[list[Path], list[str]]:
    files, problems = [], []
    for raw in paths:
        try:
            found, _ = csv_files([raw], pattern="*_harmony.csv")
        except InputError as err:
            problems.append(str(err))
            continue
        if Path(raw).is_dir() and not found:
            problems.append(problem(raw, "no *_harmony.csv files below this folder"))
        files += [path for path in found if path not in files]
    return files, problems


def check_paths(paths: Sequence, sum_tolerance: float = SUM_TOLERANCE,
                argmax_tolerance: float = ARGMAX_TOLERANCE) -> tuple[int, int, list[str]]:
    """(files, rows, every problem found)."""
    files, problems = files_to_check(paths)
    rows = 0
    for path in files:
        count, found = check_file(path, sum_tolerance, argmax_tolerance)
        rows += count
        problems += found
    return len(files), rows, problems


def check_settings(settings) -> None:
    """ValueError naming a tolerance outside its range (non-finite ones are refused when parsed)."""
    for name, high in (("SUM_TOLERANCE", _MAX_SUM_TOLERANCE), ("ARGMAX_TOLERANCE", _MAX_ARGMAX_TOLERANCE)):
        if not 0.0 <= settings[name] <= high:
            raise ValueError(f"--{name}={settings[name]!r}: must be in 0..{high:g}")


def main(argv: list[str] | None = None) -> int:
    from tes_grpo.run.script_config import resolve

    settings = resolve(globals(), argv, positional="PATHS")
    try:
        check_settings(settings)
    except ValueError as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    n_files, n_rows, problems = check_paths(settings.PATHS, settings.SUM_TOLERANCE, settings.ARGMAX_TOLERANCE)
    for line in problems:
        print(line)
    if problems:
        print(f"error: {len(problems)} problem(s) in {n_files} file(s), {n_rows} row(s)", file=sys.stderr)
        return 1
    print(f"ok: {n_files} file(s), {n_rows} row(s)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
