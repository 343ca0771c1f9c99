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
The windows are written all or none; existing ones are replaced only with --OVERWRITE.
Exit status: 0 done, 1 failed write or existing output, 2 bad setting.
"""

from __future__ import annotations

import math
import random
import re
import sys
from datetime import date, datetime, timedelta
from pathlib import Path

from tes_grpo.task import tes_env

OUT_DIR = "data/series"  # folder for the window CSVs
N_WINDOWS = 12  # number of 4-day windows (1..10000)
SEED = 2024  # random seed; the same seed gives the same bytes
START_DATE = "2024-06-03"  # first day of the first window (ISO date YYYY-MM-DD)
WINDOW_PREFIX = "tes"  # file names: <prefix>_<first date>.csv (letters, digits, '_', '-', '.')
OVERWRITE = False  # replace existing window files

CO2_MIN = 0.18  # kg/kWh, lower clip of the CO2 factor (0 <= CO2_MIN < CO2_MAX)
CO2_MAX = 0.56  # kg/kWh, upper clip of the CO2 factor (at most tes_env.MAX_CO2_KG_PER_KWH = 10)
LOAD_MEAN_RANGE = (25.0, 35.0)  # kW, range of a day's business-hour mean load (0 <= low <= high <= 60)

_DAYS_PER_WINDOW = tes_env.SERIES_DAYS  # 3-day episode + the day that prices the energy left
_MAX_WINDOWS = 10_000  # 110 years of hourly data; more is a typo
_HOURLY_LOAD_CLIP_KW = (5.0, 60.0)  # an open business hour's load stays in this range


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


def generate_days(n_days: int, seed: int, co2_range: tuple[float, float] = (CO2_MIN, CO2_MAX),
                  load_mean_range: tuple[float, float] = LOAD_MEAN_RANGE,
                  ) -> tuple[list[list[float]], list[list[float]]]:
    """(co2, load): n_days lists of 24 hourly values for consecutive days, rounded to 0.001 / 0.1."""
    co2_min, co2_max = co2_range
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
            co2.append(round(_clip(value, co2_min, co2_max), 3))
        low, high = load_mean_range
        mean_load = _clip(30.0 + 4.0 * heat + noise.normal(1.0), low, high)
        load = [0.0] * 24
        for index, hour in enumerate(range(8, 18)):
            load[hour] = round(_clip(mean_load * _LOAD_SHAPE[index] * (1.0 + noise.normal(0.05)),
                                    *_HOURLY_LOAD_CLIP_KW), 1)
        co2_days.append(co2)
        load_days.append(load)
    return co2_days, load_days


def window_name(prefix: str, first_day: date) -> str:
    return f"{prefix}_{first_day.isoformat()}"


def series_csv_text(first_day: date, co2: list[list[float]], load: list[list[float]]) -> str:
    """CSV text of consecutive days from `first_day` 00:00; fixed number formats for stable bytes."""
    lines = ["datetime,co2_kg_per_kwh,cooling_load_kw"]
    start = datetime.combine(first_day, datetime.min.time())
    hourly = zip((v for day in co2 for v in day), (v for day in load for v in day), strict=True)
    for index, (factor, kw) in enumerate(hourly):
        moment = start + timedelta(hours=index)
        lines.append(f"{moment:%Y-%m-%dT%H:%M:%S},{factor:.3f},{kw:.1f}")
    return "\n".join(lines) + "\n"


def generate_windows(n_windows: int = N_WINDOWS, seed: int = SEED, start_date: str = START_DATE,
                     prefix: str = WINDOW_PREFIX, co2_range: tuple[float, float] = (CO2_MIN, CO2_MAX),
                     load_mean_range: tuple[float, float] = LOAD_MEAN_RANGE) -> dict[str, str]:
    """{window name: CSV text} for `n_windows` consecutive 4-day windows."""
    first = date.fromisoformat(start_date)
    co2, load = generate_days(n_windows * _DAYS_PER_WINDOW, seed, co2_range, load_mean_range)
    windows = {}
    for w in range(n_windows):
        days = slice(w * _DAYS_PER_WINDOW, (w + 1) * _DAYS_PER_WINDOW)
        first_day = first + timedelta(days=w * _DAYS_PER_WINDOW)
        windows[window_name(prefix, first_day)] = series_csv_text(first_day, co2[days], load[days])
    return windows


def parse_start_date(text: str, n_windows: int = 1, name: str = "START_DATE") -> date:
    """The first day as a date; ValueError naming the setting if it is not a real YYYY-MM-DD date or the
    last window would end after the year 9999."""
    try:
        if not re.fullmatch(r"\d{4}-\d{2}-\d{2}", text):
            raise ValueError("expected YYYY-MM-DD")
        first = date.fromisoformat(text)
    except ValueError as err:
        raise ValueError(f"--{name}={text!r}: not a real date ({err})") from None
    try:
        first + timedelta(days=n_windows * _DAYS_PER_WINDOW)
    except OverflowError:
        raise ValueError(f"--{name}={text!r}: {n_windows} windows from it run past the year 9999") from None
    return first


def check_n_windows(n_windows: int, name: str = "N_WINDOWS") -> None:
    if not 1 <= n_windows <= _MAX_WINDOWS:
        raise ValueError(f"--{name}={n_windows!r}: must be in 1..{_MAX_WINDOWS}")


def check_settings(settings) -> None:
    """ValueError naming the first setting whose value is out of range (types are checked by resolve)."""
    check_n_windows(settings.N_WINDOWS)
    parse_start_date(settings.START_DATE, settings.N_WINDOWS)
    if not re.fullmatch(r"[A-Za-z0-9_.-]*", settings.WINDOW_PREFIX) or settings.WINDOW_PREFIX.startswith("."):
        raise ValueError(f"--WINDOW_PREFIX={settings.WINDOW_PREFIX!r}: use letters, digits, '_', '-' and '.' "
                         "(not first), no folders")
    if not 0.0 <= settings.CO2_MIN < settings.CO2_MAX <= tes_env.MAX_CO2_KG_PER_KWH:
        raise ValueError(f"--CO2_MIN={settings.CO2_MIN!r} --CO2_MAX={settings.CO2_MAX!r}: need "
                         f"0 <= CO2_MIN < CO2_MAX <= {tes_env.MAX_CO2_KG_PER_KWH:g} kg/kWh")
    low_high = settings.LOAD_MEAN_RANGE
    if len(low_high) != 2 or not 0.0 <= low_high[0] <= low_high[1] <= _HOURLY_LOAD_CLIP_KW[1]:
        text = ",".join(f"{v:g}" for v in low_high)
        raise ValueError(f"--LOAD_MEAN_RANGE={text!r}: need two numbers LOW,HIGH with "
                         f"0 <= LOW <= HIGH <= {_HOURLY_LOAD_CLIP_KW[1]:g} kW")
    out_dir = Path(settings.OUT_DIR)
    if out_dir.exists() and not out_dir.is_dir():
        raise ValueError(f"--OUT_DIR={str(settings.OUT_DIR)!r}: is a file, not a folder")


def write_windows(out_dir: str | Path, windows: dict[str, str], overwrite: bool) -> list[Path]:
    """Writes every window (all or none); InputError if one exists and not overwrite, OutputError on a failed
    write."""
    from tes_grpo.run.fileio import InputError, text_writer, write_files_atomic

    out_dir = Path(out_dir)
    targets = [out_dir / f"{name}.csv" for name in windows]
    existing = [p for p in targets if p.exists() or p.is_symlink()]
    if existing and not overwrite:
        raise InputError(existing[0], f"output exists ({len(existing)} in all); pass --OVERWRITE to replace")
    return write_files_atomic([(path, text_writer(text))
                               for path, text in zip(targets, windows.values(), strict=True)])


def main(argv: list[str] | None = None) -> int:
    from tes_grpo.run.fileio import InputError
    from tes_grpo.run.script_config import resolve

    settings = resolve(globals(), argv)
    try:
        check_settings(settings)
    except ValueError as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    windows = generate_windows(settings.N_WINDOWS, settings.SEED, settings.START_DATE, settings.WINDOW_PREFIX,
                               (settings.CO2_MIN, settings.CO2_MAX), tuple(settings.LOAD_MEAN_RANGE))
    try:
        paths = write_windows(settings.OUT_DIR, windows, settings.OVERWRITE)
    except InputError as err:
        print(f"error: {err}", file=sys.stderr)
        return 1
    for path in paths:
        print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
