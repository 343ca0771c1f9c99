"""Regenerates the example data in data/ byte for byte: series, Q datasets, rewards, Harmony prompts.

    python make_example_data.py            # rewrites data/series, data/train, data/eval
    python make_example_data.py --CHECK    # regenerates into a temporary folder and compares with data/

Steps (each the function of the script named): make_series.py writes N_WINDOWS seeded 4-day windows to
OUT_DIR/series; make_q_dataset.py writes one <window>_q_dataset.csv per window (30 rows, exact Q), every
EVAL_EVERY-th window into OUT_DIR/eval and the rest into OUT_DIR/train; calculate_reward.py adds
reward_action_0..3 (tau TAU) in place; convert_to_harmony.py writes <window>_q_dataset_harmony.csv with the
pinned date; check_data.py validates the result. Prints the optimal-vs-rule-policy table.
Exit status: 0 done (or, with --CHECK, identical), 1 a failed write or a difference, 2 bad setting.
"""

from __future__ import annotations

import filecmp
import math
import sys
import tempfile
from pathlib import Path

import calculate_reward
import check_data
import convert_to_harmony
import make_q_dataset
import make_series
from tes_grpo.task import tes_env

OUT_DIR = "data"  # folder that receives series/, train/ and eval/
N_WINDOWS = 12  # number of 4-day windows
SEED = 2024  # seed of the series generator
START_DATE = "2024-06-03"  # first day of the first window (YYYY-MM-DD)
EVAL_EVERY = 4  # windows 4, 8, 12 (1-based) go to eval/, the others to train/ (>= 1)
TAU = 0.05  # softmax temperature of the rewards (finite, > 0)
CHECK = False  # regenerate into a temporary folder and compare with OUT_DIR instead of writing it

_SUBFOLDERS = ("series", "train", "eval")


def split_of(index: int, eval_every: int = EVAL_EVERY) -> str:
    """'eval' for every eval_every-th window (0-based index), else 'train'."""
    return "eval" if (index + 1) % eval_every == 0 else "train"


def make_example_data(out_dir: str | Path, n_windows: int = N_WINDOWS, seed: int = SEED,
                      start_date: str = START_DATE, eval_every: int = EVAL_EVERY, tau: float = TAU,
                      tokenizer=None, progress: bool = True) -> tuple[list[Path], dict]:
    """Writes every file of the example data under out_dir; returns (files written, policy table)."""
    from tqdm import tqdm

    out_dir = Path(out_dir)
    windows = make_series.generate_windows(n_windows, seed, start_date)
    series_paths = make_series.write_windows(out_dir / "series", windows, overwrite=True)
    q_paths, table = [], {}
    for index, path in enumerate(tqdm(series_paths, desc="Q datasets", unit="window", disable=not progress)):
        series = tes_env.load_series(path)
        solver = tes_env.QSolver(series)
        target = make_q_dataset.output_path(path, out_dir / split_of(index, eval_every))
        make_q_dataset.write_dataset(make_q_dataset.dataset_rows(series, solver=solver), target)
        q_paths.append(target)
        table[f"{series.name} ({split_of(index, eval_every)})"] = make_q_dataset.compare_policies(
            series, solver=solver)
    calculate_reward.calculate_rewards(q_paths, tau, overwrite=True)
    harmony_paths = convert_to_harmony.convert_files(q_paths, overwrite=True, tokenizer=tokenizer, progress=progress)
    _, _, problems = check_data.check_paths(harmony_paths)
    if problems:
        raise RuntimeError("the generated data fails check_data.py:\n" + "\n".join(problems))
    return [*series_paths, *q_paths, *harmony_paths], table


def data_files(root: str | Path) -> list[str]:
    """Relative paths of the files under root's series/, train/ and eval/ folders."""
    root = Path(root)
    return sorted(str(p.relative_to(root)) for sub in _SUBFOLDERS if (root / sub).is_dir()
                  for p in (root / sub).rglob("*") if p.is_file())


def compare_trees(expected: str | Path, actual: str | Path) -> list[str]:
    """Differences between two data folders (missing, extra or differing files); empty if identical."""
    expected_files, actual_files = set(data_files(expected)), set(data_files(actual))
    lines = [f"missing in {actual}: {name}" for name in sorted(expected_files - actual_files)]
    lines += [f"not regenerated (extra in {actual}): {name}" for name in sorted(actual_files - expected_files)]
    lines += [f"differs: {name}" for name in sorted(expected_files & actual_files)
              if not filecmp.cmp(Path(expected) / name, Path(actual) / name, shallow=False)]
    return lines


def check_settings(settings) -> None:
    """ValueError naming the first setting whose value is out of range."""
    make_series.check_n_windows(settings.N_WINDOWS)
    make_series.parse_start_date(settings.START_DATE, settings.N_WINDOWS)
    if settings.EVAL_EVERY < 1:
        raise ValueError(f"--EVAL_EVERY={settings.EVAL_EVERY!r}: must be >= 1")
    if not (math.isfinite(settings.TAU) and settings.TAU > 0):
        raise ValueError(f"--TAU={settings.TAU!r}: must be a finite number > 0")
    out_dir = Path(settings.OUT_DIR)
    if out_dir.exists() and not out_dir.is_dir():
        raise ValueError(f"--OUT_DIR={str(settings.OUT_DIR)!r}: is a file, not a folder")


def main(argv: list[str] | None = None) -> int:
    from tes_grpo.run.fileio import InputError
    from tes_grpo.run.script_config import resolve

    settings = resolve(globals(), argv)
    try:
        check_settings(settings)
    except ValueError as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    steps = (settings.N_WINDOWS, settings.SEED, settings.START_DATE, settings.EVAL_EVERY, settings.TAU)
    out_dir = settings.OUT_DIR
    try:
        if settings.CHECK:
            with tempfile.TemporaryDirectory() as tmp:
                make_example_data(tmp, *steps)
                differences = compare_trees(tmp, out_dir)
            for line in differences:
                print(line)
            if differences:
                print(f"error: {out_dir} differs from a fresh regeneration ({len(differences)} file(s))",
                      file=sys.stderr)
                return 1
            print(f"ok: {out_dir} equals a fresh regeneration byte for byte")
            return 0
        written, table = make_example_data(out_dir, *steps)
    except (InputError, ValueError) as err:  # ValueError: the tokenizer could not be loaded
        print(f"error: {err}", file=sys.stderr)
        return 1
    print(f"wrote {len(written)} files under {out_dir}/ ({', '.join(_SUBFOLDERS)})")
    stale = sorted(set(data_files(out_dir)) - {str(p.relative_to(out_dir)) for p in written})
    for name in stale:
        print(f"note: {Path(out_dir) / name} was not written by this run (left as it is)")
    print()
    print(make_q_dataset.format_policy_table(table))
    return 0


if __name__ == "__main__":
    sys.exit(main())
