"""Seeded generator of realistic hourly input series for the TES plant (4-day windows).

    python make_series.py --OUT_DIR=data/series --N_WINDOWS=12 --SEED=2024 --START_DATE=2024-06-03

Writes OUT_DIR/<window>.csv with exactly the columns datetime,co2_kg_per_kwh,cooling_load_kw, 96 rows each.
The windows are consecutive, non-overlapping 4-day pieces of one continuous summer series:
- CO2 factor (kg/kWh), about 0.18-0.56: a night plateau, a morning shoulder, a midday solar dip whose depth
  follows each day's sunshine, an evening peak, a daily level that wanders with wind, and hourly noise.
- Cooling load (kW): 0 outside business hours 08:00-17:00; inside, a morning ramp to an afternoon peak,
  scaled by each day's heat (business-hour means about 25-35 kW, peaks near 50 kW), plus noise.
Values are rounded to 0.1 kW and 0.001 kg/kWh, the precision the prompts print, so a prompt shows
exactly the numbers the Q-values were computed from. Same settings, same bytes.
"""

from __future__ import annotations

import math
import random
import sys
from datetime import date, datetime, timedelta
from pathlib import Path

from tes_grpo import tes_env
OUT_DIR = "data/series"  # folder for the window CSVs
N_WINDOWS = 12  # number of 4-day windows
SEED = 2024  # random seed; the same seed gives the same bytes
START_DATE = "2024-06-03"  # first day of the first window (ISO date)
WINDOW_PREFIX = "tes"  # file names: <prefix>_<first date>.csv
OVERWRITE = False  # replace existing window files

CO2_MIN = 0.18  # kg/kWh, lower clip of the CO2 factor
CO2_MAX = 0.56  # kg/kWh, upper clip of the CO2 factor
LOAD_MEAN_RANGE = (25.0, 35.0)  # kW, range of a day's business-hour mean load

_DAYS_PER_WINDOW = tes_env.SERIES_DAYS  # 3-day episode + the day that prices the energy left


def _bump(hour: float, centre: float, width: float) -> float:
    return math.exp(-0.5 * ((hour - centre) / width) ** 2)


def _clip(value: float, low: float, high: float) -> float:
    return min(max(value, low), high)


class _Noise:
    """Seeded Gaussian noise built only on random.random(), whose stream Python guarantees across versions
    (numpy's and random.gauss's streams are not promised to stay the same, and the data must not change)."""

    def __init__(self, seed: int):
        self.rng = random.Random(seed)

    def uniform(self) -> float:
        return self.rng.random()

    def normal(self, sigma: float) -> float:
        u1 = 1.0 - self.rng.random()  # in (0, 1], so log() is finite
        u2 = self.rng.random()
        return sigma * math.sqrt(-2.0 * math.log(u1)) * math.cos(2.0 * math.pi * u2)


# Business-hour shape of the load (08:00..17:00), mean 1: low in the morning, peak around 14:00-15:00.
_LOAD_SHAPE_RAW = [0.5 + 0.9 * _bump(hour, 14.5, 2.4) for hour in range(8, 18)]
_LOAD_SHAPE = [value * len(_LOAD_SHAPE_RAW) / sum(_LOAD_SHAPE_RAW) for value in _LOAD_SHAPE_RAW]


def generate_days(n_days: int, seed: int) -> tuple[list[list[float]], list[list[float]]]:
    """(co2, load): n_days lists of 24 hourly values for consecutive days, rounded to 0.001 / 0.1."""
    noise = _Noise(seed)
    co2_days, load_days = [], []
    level = 0.0  # wind-driven daily level, AR(1) across days
    heat = 0.0  # heat anomaly, AR(1) across days
    for _ in range(n_days):
        level = 0.6 * level + noise.normal(0.03)
        heat = 0.7 * heat + noise.normal(0.45)
        sunshine = _clip(1.0 - 0.9 * noise.uniform() ** 2, 0.15, 1.0)  # mostly sunny, some cloudy days
        previous = 0.0
        co2 = []
        for hour in range(24):
            previous = 0.5 * previous + noise.normal(0.012)
            value = (0.42 + level
                     + 0.04 * _bump(hour, 8.0, 1.5)  # morning demand shoulder
                     - 0.21 * sunshine * _bump(hour, 12.5, 2.4)  # solar dip
                     + 0.09 * _bump(hour, 19.5, 1.8)  # evening peak as the sun sets
                     + previous)
            co2.append(round(_clip(value, CO2_MIN, CO2_MAX), 3))
        low, high = LOAD_MEAN_RANGE
        mean_load = _clip(30.0 + 4.0 * heat + noise.normal(1.0), low, high)
        load = [0.0] * 24
        for index, hour in enumerate(range(8, 18)):
            load[hour] = round(_clip(mean_load * _LOAD_SHAPE[index] * (1.0 + noise.normal(0.05)), 5.0, 60.0), 1)
        co2_days.append(co2)
        load_days.append(load)
    return co2_days, load_days


def window_name(prefix: str, first_day: date) -> str:
    return f"{prefix}_{first_day.isoformat()}"


def series_csv_text(first_day: date, co2: list[list[float]], load: list[list[float]]) -> str:
    """CSV text of consecutive days from `first_day` 00:00; fixed number formats for stable bytes."""
    lines = ["datetime,co2_kg_per_kwh,cooling_load_kw"]
    start = datetime.combine(first_day, datetime.min.time())
    hourly = zip((v for day in co2 for v in day), (v for day in load for v in day))
    for index, (factor, kw) in enumerate(hourly):
        moment = start + timedelta(hours=index)
        lines.append(f"{moment:%Y-%m-%dT%H:%M:%S},{factor:.3f},{kw:.1f}")
    return "\n".join(lines) + "\n"


def generate_windows(n_windows: int = N_WINDOWS, seed: int = SEED, start_date: str = START_DATE,
                     prefix: str = WINDOW_PREFIX) -> dict[str, str]:
    """{window name: CSV text} for `n_windows` consecutive 4-day windows."""
    first = date.fromisoformat(start_date)
    co2, load = generate_days(n_windows * _DAYS_PER_WINDOW, seed)
    windows = {}
    for w in range(n_windows):
        days = slice(w * _DAYS_PER_WINDOW, (w + 1) * _DAYS_PER_WINDOW)
        first_day = first + timedelta(days=w * _DAYS_PER_WINDOW)
        windows[window_name(prefix, first_day)] = series_csv_text(first_day, co2[days], load[days])
    return windows


def write_windows(out_dir: str | Path, windows: dict[str, str], overwrite: bool) -> list[Path]:
    from tes_grpo.fileio import atomic_write_text

    out_dir = Path(out_dir)
    targets = [out_dir / f"{name}.csv" for name in windows]
    existing = [str(p) for p in targets if p.exists()]
    if existing and not overwrite:
        raise FileExistsError(f"{len(existing)} output(s) exist (first: {existing[0]}); pass --overwrite")
    for path, text in zip(targets, windows.values()):
        atomic_write_text(path, text)
    return targets


def main() -> None:
    from tes_grpo.script_config import configure

    configure(globals())
    windows = generate_windows(N_WINDOWS, SEED, START_DATE, WINDOW_PREFIX)
    try:
        paths = write_windows(OUT_DIR, windows, OVERWRITE)
    except FileExistsError as err:
        print(f"error: {err}", file=sys.stderr)
        sys.exit(1)
    for path in paths:
        print(f"wrote {path}")


if __name__ == "__main__":
    main()
