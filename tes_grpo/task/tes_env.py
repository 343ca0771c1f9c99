"""The TES cooling plant: its input series, one hour of it (`step`) and exact dynamic programming over Q (`QSolver`).

A library module (no command); the data scripts (`make_series.py`, `make_q_dataset.py`, `calculate_reward.py`,
`check_data.py`) and the evaluators import it; the operator's prompt for a state is task_prompt.py's, and the
policies and the closed loop that runs them over whole episodes are tes_policies.py's.
Facts of the plant:

- An air-source heat pump (ASHP), rated cooling output 100 kW, constant COP 4.0; a TES of 300 kWh.
- Actions 0..3 set the ASHP output ratio to 0, 1/3, 2/3, 1: scheduled cooling `Qs = ratio * 100` kWh.
- Business hours 08:00-17:00 (10 decisions a day). Outside them the load is 0 and only action 0 exists.
- In an hour with load L: the ASHP serves min(L, Qs); the TES discharges min(L - served, E); the rest is
  unserved; the surplus Qs - served charges the TES up to its capacity, what does not fit is wasted.
- Emissions: Qs / COP * co2 kg. Step reward: -(emissions + 10 * unserved_kWh) / 6.
- An episode is 72 hours from 00:00 of day 1 with E = 150 kWh. After the 17:00 hour of day 3 a terminal
  credit co2_low5 * E / COP / 6 is added (co2_low5: mean of the 5 lowest CO2 factors among day 4's
  business hours), so a series covers 4 days (96 hours).
- Q_t(E, a) = r_t(E, a) + V_{t+1}(E'), undiscounted, V = max over the allowed actions.

Exactness: E' = clip(E + Qs - L, 0, 300), so every energy reachable from a state is "a clip point (0,
300 or the start) plus k * 100/3 minus the loads since then": a few hundred values per hour. `QSolver`
evaluates V by memoised recursion on exactly those reachable energies, so Q is exact up to float
rounding (~1e-12), with no grid and no interpolation.
"""

from __future__ import annotations

import dataclasses
import math
import numbers
from datetime import datetime, timedelta
from pathlib import Path
from typing import Sequence

from tes_grpo.run.fileio import InputError, parse_finite, read_csv_rows

RATED_KW = 100.0  # ASHP rated cooling output (kW); one hour at ratio 1 schedules 100 kWh
COP = 4.0  # ASHP coefficient of performance (kWh cooling per kWh electricity), constant
CAPACITY_KWH = 300.0  # TES capacity (kWh)
ACTION_RATIOS = (0.0, 1.0 / 3.0, 2.0 / 3.0, 1.0)  # ASHP output ratio of actions 0..3
N_ACTIONS = len(ACTION_RATIOS)
FIRST_BUSINESS_HOUR = 8  # 08:00 is the first decision of a day
LAST_BUSINESS_HOUR = 17  # 17:00 is the last one; the building closes at 18:00
BUSINESS_HOURS = tuple(range(FIRST_BUSINESS_HOUR, LAST_BUSINESS_HOUR + 1))
UNSERVED_PENALTY_KG_PER_KWH = 10.0  # an unserved kWh costs as much as 10 kg CO2
REWARD_SCALE = 6.0  # rewards are -(kg CO2 equivalent) / 6
EPISODE_DAYS = 3
EPISODE_HOURS = 24 * EPISODE_DAYS  # timesteps 0..71
SERIES_DAYS = EPISODE_DAYS + 1  # day 4 prices the energy left at the end
SERIES_HOURS = 24 * SERIES_DAYS
TERMINAL_TIMESTEP = 24 * (EPISODE_DAYS - 1) + LAST_BUSINESS_HOUR + 1  # 66: the credit is paid on E_66
INITIAL_ENERGY_KWH = 150.0
LOW_CO2_COUNT = 5  # co2_low5 averages this many lowest day-4 business-hour factors
SERIES_COLUMNS = ("datetime", "co2_kg_per_kwh", "cooling_load_kw")
# Sanity limits of a series' values. No grid emits more than about 1.2 kg CO2/kWh (lignite), so a factor above 10
# is a unit mistake (g/kWh); a cooling load above 10x the heat pump's rating is one too (W for kW). Values within
# them keep every Q-value finite and exact.
MAX_CO2_KG_PER_KWH = 10.0
MAX_LOAD_KW = 10 * RATED_KW
ENERGY_KEY_DECIMALS = 9  # float energies equal to 1e-9 kWh share one memo entry (paths differ by ~1e-13)
TIE_TOLERANCE = 1e-9  # Q-values this close count as a tie; the lowest action wins
Q_COLUMNS = tuple(f"q_action_{a}" for a in range(N_ACTIONS))
REWARD_COLUMNS = tuple(f"reward_action_{a}" for a in range(N_ACTIONS))
REWARD_SUM_TOLERANCE = 1e-6  # a row's rewards (a softmax written with repr) sum to 1 within this
# columns of <series>_q_dataset.csv as make_q_dataset.py writes them (calculate_reward.py adds REWARD_COLUMNS
# after q_action_3)
DATASET_COLUMNS = ("timestep", "timestamp", "prompt", "optimal_action", *Q_COLUMNS, "series", "tes_energy_kwh",
                   "on_trajectory")


def reward_problems(rewards, sum_tolerance: float = REWARD_SUM_TOLERANCE) -> list[tuple[int | None, str]]:
    """What is wrong with one row's rewards (finite floats, actions 0..3): (the action whose reward is wrong, or None
    for the row, and why). calculate_reward.py writes a softmax of the Q-values: each in [0, 1], summing to 1."""
    problems: list[tuple[int | None, str]] = [(a, f"reward {r!r} is outside [0, 1]") for a, r in enumerate(rewards)
                                              if not 0.0 <= r <= 1.0]
    total = math.fsum(rewards)
    if abs(total - 1.0) > sum_tolerance:
        problems.append((None, f"rewards sum to {total!r}, not 1"))
    return problems


# ---------------------------------------------------------------------------------------------------
# Input series


@dataclasses.dataclass(frozen=True)
class Series:
    """Four whole days of hourly inputs starting at 00:00 (96 hours)."""

    name: str
    datetimes: tuple[datetime, ...]
    co2: tuple[float, ...]  # kg CO2 per kWh of electricity
    load: tuple[float, ...]  # cooling load (kW = kWh in the hour); 0 outside business hours

    def __post_init__(self):
        if not (len(self.datetimes) == len(self.co2) == len(self.load) == SERIES_HOURS):
            raise ValueError(f"series {self.name!r} needs {SERIES_HOURS} hours, got "
                             f"{len(self.datetimes)}/{len(self.co2)}/{len(self.load)}")


def series_from_rows(rows: Sequence[Sequence[str]], name: str, path="<series>") -> Series:
    """Validates string rows (datetime, co2, load) and builds a Series; rows are numbered from 1.

    Raises InputError naming the file, row, column and value of the first problem.
    """
    if len(rows) != SERIES_HOURS:
        raise InputError(path, f"needs exactly {SERIES_HOURS} hourly rows (4 whole days from 00:00), "
                               f"found {len(rows)}")
    datetimes, co2, load = [], [], []
    for index, row in enumerate(rows):
        number = index + 1
        text_time, text_co2, text_load = (str(cell).strip() for cell in row)
        try:
            moment = datetime.fromisoformat(text_time)
        except ValueError:
            raise InputError(path, "not an ISO date-time", row=number, column="datetime",
                             value=text_time) from None
        if moment.tzinfo is not None:
            moment = moment.replace(tzinfo=None)
        if index == 0 and (moment.hour, moment.minute, moment.second) != (0, 0, 0):
            raise InputError(path, "the series must start at 00:00", row=number, column="datetime",
                             value=text_time)
        if index > 0 and moment - datetimes[-1] != timedelta(hours=1):
            raise InputError(path, "rows must be consecutive hours", row=number, column="datetime",
                             value=text_time)
        factor = parse_finite(path, number, "co2_kg_per_kwh", text_co2)
        if factor < 0:
            raise InputError(path, "CO2 factor must be >= 0", row=number, column="co2_kg_per_kwh",
                             value=text_co2)
        if factor > MAX_CO2_KG_PER_KWH:
            raise InputError(path, f"CO2 factor must be at most {MAX_CO2_KG_PER_KWH:g} kg/kWh (is it in g/kWh?)",
                             row=number, column="co2_kg_per_kwh", value=text_co2)
        kw = parse_finite(path, number, "cooling_load_kw", text_load)
        if kw < 0:
            raise InputError(path, "cooling load must be >= 0", row=number, column="cooling_load_kw",
                             value=text_load)
        if kw > MAX_LOAD_KW:
            raise InputError(path, f"cooling load must be at most {MAX_LOAD_KW:g} kW, 10x the heat pump's rating "
                                   "(is it in W?)", row=number, column="cooling_load_kw", value=text_load)
        if kw != 0 and moment.hour not in BUSINESS_HOURS:
            raise InputError(path, "cooling load must be 0 outside business hours 08:00-17:00",
                             row=number, column="cooling_load_kw", value=text_load)
        datetimes.append(moment)
        co2.append(factor)
        load.append(kw)
    return Series(name=name, datetimes=tuple(datetimes), co2=tuple(co2), load=tuple(load))


def load_series(path: str | Path) -> Series:
    """Reads a series CSV with exactly the columns datetime,co2_kg_per_kwh,cooling_load_kw (96 rows).

    UTF-8, with or without a byte-order mark; InputError naming the file (and row, column, value) on any problem.
    """
    path = Path(path)
    table = read_csv_rows(path)
    if not table:
        raise InputError(path, "empty file")
    header = table[0]
    if header != list(SERIES_COLUMNS):
        raise InputError(path, f"columns must be exactly {','.join(SERIES_COLUMNS)}; found {','.join(header)}")
    rows = table[1:]
    for number, row in enumerate(rows, start=1):
        if len(row) != len(SERIES_COLUMNS):
            raise InputError(path, f"expected {len(SERIES_COLUMNS)} cells, found {len(row)}", row=number)
    return series_from_rows(rows, name=path.stem, path=path)


# ---------------------------------------------------------------------------------------------------
# Time


def day_of(t: int) -> int:
    """Day index (0-based) of timestep t."""
    return t // 24


def hour_of(t: int) -> int:
    return t % 24


def is_business_hour(t: int) -> bool:
    return hour_of(t) in BUSINESS_HOURS


def business_timesteps(days: int = EPISODE_DAYS) -> list[int]:
    """Decision timesteps of the episode: 30 for 3 days (8..17, 32..41, 56..65)."""
    return [t for t in range(24 * days) if is_business_hour(t)]


def allowed_actions(t: int) -> tuple[int, ...]:
    return tuple(range(N_ACTIONS)) if is_business_hour(t) else (0,)


# ---------------------------------------------------------------------------------------------------
# One hour of the plant


@dataclasses.dataclass(frozen=True)
class StepResult:
    """What one hour did; energies in kWh, emissions in kg CO2, reward as the issue defines it."""

    energy: float  # TES energy after the hour
    scheduled: float  # ASHP output Qs
    served: float  # load served by the ASHP
    discharged: float  # load served by the TES
    unserved: float
    charged: float  # surplus stored in the TES
    wasted: float  # surplus that did not fit
    emissions_kg: float
    reward: float


def scheduled_kwh(action: int) -> float:
    return RATED_KW * ACTION_RATIOS[action]


def transition(energy: float, load: float, co2: float, action: int) -> StepResult:
    """One hour with TES energy `energy`, cooling load `load` and CO2 factor `co2` under `action`."""
    if not 0 <= action < N_ACTIONS:
        raise ValueError(f"action {action} is not in 0..{N_ACTIONS - 1}")
    if not 0.0 <= energy <= CAPACITY_KWH:
        raise ValueError(f"TES energy {energy} kWh is outside 0..{CAPACITY_KWH}")
    scheduled = scheduled_kwh(action)
    served = min(load, scheduled)
    discharged = min(load - served, energy)
    unserved = load - served - discharged
    surplus = scheduled - served
    # the new energy is the clip itself (not energy + charged) so that it never leaves [0, capacity]
    if surplus > 0:
        new_energy = min(energy + surplus, CAPACITY_KWH)
        charged = new_energy - energy
    else:
        new_energy = energy - discharged
        charged = 0.0
    wasted = surplus - charged
    emissions = scheduled / COP * co2
    reward = -(emissions + UNSERVED_PENALTY_KG_PER_KWH * unserved) / REWARD_SCALE
    return StepResult(energy=new_energy, scheduled=scheduled, served=served, discharged=discharged,
                      unserved=unserved, charged=charged, wasted=wasted, emissions_kg=emissions, reward=reward)


def step(series: Series, t: int, energy: float, action: int) -> StepResult:
    """Hour t of `series`; off business hours only action 0 is allowed (ValueError otherwise)."""
    if not 0 <= t < EPISODE_HOURS:
        raise ValueError(f"timestep {t} is outside the episode 0..{EPISODE_HOURS - 1}")
    if action not in allowed_actions(t):
        raise ValueError(f"action {action} is not allowed at timestep {t} (hour {hour_of(t):02d}:00)")
    return transition(energy, series.load[t], series.co2[t], action)


def business_values(series: Series, day: int, values: Sequence[float]) -> list[float]:
    return [values[24 * day + hour] for hour in BUSINESS_HOURS]


def co2_low5(series: Series) -> float:
    """Mean of the 5 lowest CO2 factors among the business hours of day 4 (index 3)."""
    return low_co2_mean(series, EPISODE_DAYS)


def low_co2_mean(series: Series, day: int) -> float:
    lowest = sorted(business_values(series, day, series.co2))[:LOW_CO2_COUNT]
    return sum(lowest) / len(lowest)


def terminal_credit(series: Series, energy: float) -> float:
    """Reward added after the 17:00 hour of day 3 for the energy left in the TES."""
    return co2_low5(series) * energy / COP / REWARD_SCALE


# ---------------------------------------------------------------------------------------------------
# Exact dynamic programming


def best_action(q_values: Sequence[float | None]) -> int:
    """Index of the largest Q (disallowed actions are None); near-ties go to the lowest index."""
    allowed = [q for q in q_values if q is not None]
    top = max(allowed)
    return next(a for a, q in enumerate(q_values) if q is not None and q >= top - TIE_TOLERANCE)


class QSolver:
    """Exact V and Q of one series by memoised recursion over the reachable TES energies.

    `value(t, E)` is V_t(E): the best return from timestep t (before its hour) with TES energy E,
    including the terminal credit. `q_values(t, E)` lists Q_t(E, a) for a = 0..3 (None where the action
    is not allowed). Works for any energy in [0, 300], on or off the optimal trajectory.
    """

    def __init__(self, series: Series):
        self.series = series
        self._credit_per_kwh = co2_low5(series) / COP / REWARD_SCALE
        self._memo: dict[tuple[int, float], float] = {}

    @property
    def states_evaluated(self) -> int:
        return len(self._memo)

    def value(self, t: int, energy: float) -> float:
        check_energy(energy)
        return self._value(t, float(energy))

    def q_values(self, t: int, energy: float) -> list[float | None]:
        check_energy(energy)
        allowed = allowed_actions(t)
        return [self._q(t, float(energy), a) if a in allowed else None for a in range(N_ACTIONS)]

    def optimal_action(self, t: int, energy: float) -> int:
        return best_action(self.q_values(t, energy))

    def _q(self, t: int, energy: float, action: int) -> float:
        if t >= TERMINAL_TIMESTEP:
            # after the last decision only action 0 exists and nothing changes; Q is the credit
            return self._credit_per_kwh * energy
        result = transition(energy, self.series.load[t], self.series.co2[t], action)
        return result.reward + self._value(t + 1, result.energy)

    def _value(self, t: int, energy: float) -> float:
        # off business hours the load is 0 and only action 0 exists: nothing changes, reward 0
        while t < TERMINAL_TIMESTEP and not is_business_hour(t):
            t += 1
        if t >= TERMINAL_TIMESTEP:
            return self._credit_per_kwh * energy
        key = (t, round(energy, ENERGY_KEY_DECIMALS))
        cached = self._memo.get(key)
        if cached is None:
            cached = max(self._q(t, energy, a) for a in range(N_ACTIONS))
            self._memo[key] = cached
        return cached


def check_energy(energy: float) -> None:
    if isinstance(energy, bool) or not isinstance(energy, numbers.Real) or not 0.0 <= energy <= CAPACITY_KWH:
        raise ValueError(f"TES energy {energy!r} kWh is outside 0..{CAPACITY_KWH}")


@dataclasses.dataclass(frozen=True)
class Decision:
    """One business-hour state of a trajectory with its exact Q-values."""

    t: int
    energy: float
    q_values: tuple[float, ...]
    action: int


def optimal_trajectory(solver: QSolver, initial_energy: float = INITIAL_ENERGY_KWH) -> list[Decision]:
    """Rolls out the optimal policy from 00:00 of day 1; one Decision per business hour (30)."""
    energy = float(initial_energy)
    check_energy(energy)
    decisions = []
    for t in range(TERMINAL_TIMESTEP):
        if not is_business_hour(t):
            continue
        q = solver.q_values(t, energy)
        action = best_action(q)
        decisions.append(Decision(t=t, energy=energy, q_values=tuple(q), action=action))
        energy = step(solver.series, t, energy, action).energy
    return decisions
