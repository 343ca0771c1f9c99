"""Exact Q-value datasets from hourly series: one row per business hour of the optimal trajectory.

    python make_q_dataset.py SERIES.csv [SERIES2.csv ...] --OUT_DIR=DIR [--INITIAL_ENERGY=150]

For each SERIES.csv (columns exactly datetime,co2_kg_per_kwh,cooling_load_kw; 4 whole days from 00:00)
it writes OUT_DIR/SERIES_q_dataset.csv with columns
    timestep,timestamp,prompt,optimal_action,q_action_0,q_action_1,q_action_2,q_action_3,
    series,tes_energy_kwh,on_trajectory
one row per business hour of the optimal rollout from INITIAL_ENERGY (30 rows), Q exact (tes_env.QSolver)
and written with 6 decimals. `prompt` is the legacy two-part text (`system:` / `user:`).
Off-trajectory states (other TES energies at the same hours, on_trajectory=0) are added by
--OFF_TRAJECTORY_ENERGIES=0,100,200,300 (fixed kWh) and/or --OFF_TRAJECTORY_RANDOM=N (N seeded uniform
energies per hour). At the end it prints the net CO2 of the optimum against rule policies per series.
Every series is checked and every dataset computed before anything is written; the datasets are then written
all or none (an existing output is replaced only with --OVERWRITE; a symlinked output has its target replaced).
Exit status: 0 done, 1 bad input file or failed write, 2 bad setting.
"""

from __future__ import annotations

import random
import sys
from pathlib import Path

from tes_grpo.run.fileio import InputError, csv_writer, write_csv_atomic, write_files_atomic
from tes_grpo.task import task_prompt, tes_env, tes_policies

SERIES_PATHS: list = []  # input series CSVs (positional arguments)
OUT_DIR = "data"  # folder for <series>_q_dataset.csv
INITIAL_ENERGY = 150.0  # kWh in the TES at 00:00 of day 1
OFF_TRAJECTORY_ENERGIES = ""  # comma-separated kWh added as extra states at every business hour ("" = none)
OFF_TRAJECTORY_RANDOM = 0  # extra uniform-random TES energies per business hour (0 = none, at most 1000)
SEED = 0  # seed of the random off-trajectory energies and of the random policy in the table
RANDOM_POLICY_RUNS = 20  # episodes averaged for the random policy's column in the table (0..10000)
OVERWRITE = False  # replace existing output files

Q_DECIMALS = 6  # Q and energies are written with this many decimals (stable bytes; Q is exact to ~1e-12)
SAME_ENERGY_KWH = 1e-6  # an off-trajectory energy this close to the trajectory's adds no row
_MAX_RANDOM_PER_HOUR = 1000  # 30,000 extra rows per series; more is a typo, not a dataset
_MAX_POLICY_RUNS = 10_000


def output_path(series_path: str | Path, out_dir: str | Path) -> Path:
    return Path(out_dir) / f"{Path(series_path).stem}_q_dataset.csv"


def parse_energy_list(text: str, name: str = "OFF_TRAJECTORY_ENERGIES") -> list[float]:
    """'0,100,200' -> [0.0, 100.0, 200.0]; each must be a number in 0..capacity (ValueError naming the setting)."""
    energies = []
    for item in (part.strip() for part in text.split(",")):
        if not item:
            continue
        try:
            value = float(item)
        except ValueError:
            raise ValueError(f"--{name}={text!r}: {item!r} is not a number (give kWh separated by commas)") from None
        if not 0.0 <= value <= tes_env.CAPACITY_KWH:  # also refuses nan
            raise ValueError(f"--{name}={text!r}: off-trajectory energy {item} kWh is outside "
                             f"0..{tes_env.CAPACITY_KWH:g}")
        energies.append(value)
    return energies


def state_row(series: tes_env.Series, solver: tes_env.QSolver, t: int, energy: float, on_trajectory: bool,
              q_values: tuple | None = None) -> dict:
    q = list(q_values) if q_values is not None else solver.q_values(t, energy)
    system, user = task_prompt.build_prompt(series, t, energy)
    row = {
        "timestep": str(t),
        "timestamp": series.datetimes[t].isoformat(),
        "prompt": task_prompt.legacy_prompt(system, user),
        "optimal_action": str(tes_env.best_action(q)),
    }
    for column, value in zip(tes_env.Q_COLUMNS, q, strict=True):
        row[column] = f"{value:.{Q_DECIMALS}f}"
    row.update(series=series.name, tes_energy_kwh=f"{energy:.{Q_DECIMALS}f}",
               on_trajectory="1" if on_trajectory else "0")
    return row


def dataset_rows(series: tes_env.Series, initial_energy: float = tes_env.INITIAL_ENERGY_KWH,
                 extra_energies: list[float] | tuple = (), random_per_hour: int = 0, seed: int = 0,
                 solver: tes_env.QSolver | None = None) -> list[dict]:
    """Rows (dicts of strings) for the optimal trajectory, plus off-trajectory states if asked."""
    solver = solver or tes_env.QSolver(series)
    rng = random.Random(seed)
    rows = []
    for decision in tes_env.optimal_trajectory(solver, initial_energy):
        rows.append(state_row(series, solver, decision.t, decision.energy, True, decision.q_values))
        others = list(extra_energies) + [rng.uniform(0.0, tes_env.CAPACITY_KWH) for _ in range(random_per_hour)]
        for energy in sorted(others):
            if abs(energy - decision.energy) > SAME_ENERGY_KWH:
                rows.append(state_row(series, solver, decision.t, energy, False))
    return rows


def write_dataset(rows: list[dict], path: str | Path) -> Path:
    import pandas as pd

    return write_csv_atomic(pd.DataFrame(rows, columns=list(tes_env.DATASET_COLUMNS)), path)


def compare_policies(series: tes_env.Series, initial_energy: float = tes_env.INITIAL_ENERGY_KWH,
                     random_runs: int = RANDOM_POLICY_RUNS, seed: int = 0,
                     solver: tes_env.QSolver | None = None) -> dict[str, float]:
    """Net CO2 (kg: emissions + 10/unserved kWh - credit for the energy left) per policy on one series."""
    solver = solver or tes_env.QSolver(series)
    results = {"optimal": -tes_env.REWARD_SCALE * solver.value(0, initial_energy)}
    for name, policy in tes_policies.RULE_POLICIES.items():
        results[name] = tes_policies.simulate(series, policy, initial_energy).net_co2_kg
    if random_runs > 0:
        runs = [tes_policies.simulate(series, tes_policies.RandomPolicy(seed + run), initial_energy).net_co2_kg
                for run in range(random_runs)]
        results[f"random(mean of {random_runs})"] = sum(runs) / len(runs)
    return results


def format_policy_table(table: dict[str, dict[str, float]]) -> str:
    """Aligned text table: one line per series, net CO2 kg per policy, and the optimum's saving."""
    if not table:
        return "(no series)"
    policies = list(next(iter(table.values())))
    rules = [p for p in policies if p != "optimal" and not p.startswith("random")]
    name_width = max(len("series"), *(len(name) for name in table))
    widths = [max(9, len(p)) for p in policies]
    header = f"{'series':<{name_width}} " + " ".join(f"{p:>{w}}" for p, w in zip(policies, widths, strict=True))
    header += "  optimum vs best rule"
    lines = [header, "-" * len(header)]
    totals = {p: 0.0 for p in policies}
    for name, results in table.items():
        cells = " ".join(f"{results[p]:>{w}.2f}" for p, w in zip(policies, widths, strict=True))
        best_rule = min(results[p] for p in rules)
        saving = 100.0 * (best_rule - results["optimal"]) / best_rule
        lines.append(f"{name:<{name_width}} {cells}  {saving:>6.1f}% less")
        for p in policies:
            totals[p] += results[p]
    best_total = min(totals[p] for p in rules)
    cells = " ".join(f"{totals[p]:>{w}.2f}" for p, w in zip(policies, widths, strict=True))
    lines.append("-" * len(header))
    saving = 100.0 * (best_total - totals["optimal"]) / best_total
    lines.append(f"{'total':<{name_width}} {cells}  {saving:>6.1f}% less")
    lines.append("net CO2 in kg over the 3-day episode: emissions + 10 kg per unserved kWh - CO2 credited for "
                 "the TES energy left after 17:00 of day 3 (lower is better)")
    return "\n".join(lines)


def check_settings(settings) -> list[float]:
    """The off-trajectory energies; ValueError naming the setting and its value if one is out of range."""
    if not 0.0 <= settings.INITIAL_ENERGY <= tes_env.CAPACITY_KWH:
        raise ValueError(f"--INITIAL_ENERGY={settings.INITIAL_ENERGY!r}: must be in 0..{tes_env.CAPACITY_KWH:g} kWh")
    if not 0 <= settings.OFF_TRAJECTORY_RANDOM <= _MAX_RANDOM_PER_HOUR:
        raise ValueError(f"--OFF_TRAJECTORY_RANDOM={settings.OFF_TRAJECTORY_RANDOM!r}: must be in "
                         f"0..{_MAX_RANDOM_PER_HOUR}")
    if not 0 <= settings.RANDOM_POLICY_RUNS <= _MAX_POLICY_RUNS:
        raise ValueError(f"--RANDOM_POLICY_RUNS={settings.RANDOM_POLICY_RUNS!r}: must be in 0..{_MAX_POLICY_RUNS}")
    out_dir = Path(settings.OUT_DIR)
    if out_dir.exists() and not out_dir.is_dir():
        raise ValueError(f"--OUT_DIR={str(settings.OUT_DIR)!r}: is a file, not a folder")
    return parse_energy_list(settings.OFF_TRAJECTORY_ENERGIES)


def make_datasets(series_paths: list, out_dir: str | Path, initial_energy: float, extra_energies: list[float],
                  random_per_hour: int, seed: int, overwrite: bool, random_runs: int,
                  progress: bool = True) -> tuple[list[Path], dict[str, dict[str, float]]]:
    """Validates every input and computes every dataset first (nothing is written if one is bad), then writes
    them all or none."""
    import pandas as pd
    from tqdm import tqdm

    if not series_paths:
        raise InputError("<command line>", "give at least one series CSV")
    tes_env.check_energy(initial_energy)
    targets = [output_path(p, out_dir) for p in series_paths]
    if len(set(targets)) != len(targets):
        raise InputError("<command line>", "two inputs have the same file name and would share an output")
    existing = [t for t in targets if t.exists() or t.is_symlink()]
    if existing and not overwrite:
        raise InputError(existing[0], f"output exists ({len(existing)} in all); pass --OVERWRITE to replace")
    all_series = [tes_env.load_series(p) for p in series_paths]
    outputs, table = [], {}
    for series, target in tqdm(list(zip(all_series, targets, strict=True)), desc="Q datasets", unit="series",
                               disable=not progress or len(all_series) < 4):
        solver = tes_env.QSolver(series)
        rows = dataset_rows(series, initial_energy, extra_energies, random_per_hour, seed, solver)
        outputs.append((target, csv_writer(pd.DataFrame(rows, columns=list(tes_env.DATASET_COLUMNS)))))
        table[series.name] = compare_policies(series, initial_energy, random_runs, seed, solver)
    return write_files_atomic(outputs, suffix=".csv"), table


def main(argv: list[str] | None = None) -> int:
    from tes_grpo.run.script_config import resolve

    settings = resolve(globals(), argv, positional="SERIES_PATHS")
    try:
        extra = check_settings(settings)
    except ValueError as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    try:
        written, table = make_datasets(settings.SERIES_PATHS, settings.OUT_DIR, settings.INITIAL_ENERGY, extra,
                                       settings.OFF_TRAJECTORY_RANDOM, settings.SEED, settings.OVERWRITE,
                                       settings.RANDOM_POLICY_RUNS)
    except InputError as err:
        print(f"error: {err}", file=sys.stderr)
        return 1
    for path in written:
        print(f"wrote {path}")
    print()
    print(format_policy_table(table))
    return 0


if __name__ == "__main__":
    sys.exit(main())
