"""Policies that operate the TES plant, and the closed loop that runs them over whole 72-hour episodes.

A library module (no command); `make_q_dataset.py` (its states), `evaluate_policy.py` and the tests import it. A
Policy is a callable (series, t, energy) -> action, asked only at business hours: the rule policies (RULE_POLICIES),
RandomPolicy, and OptimalPolicy (tes_env.QSolver's exact Q-values). The closed loop is `simulate_batch`: several
windows in lock step, one BatchPolicy deciding all of them at each business hour (so an LLM policy batches its
prompts); `simulate` is its one-window case for a Policy. The plant itself (step, the terminal credit) is
tes_env.py's.
"""

from __future__ import annotations

import dataclasses
import random
from typing import Callable, Sequence

from tes_grpo.task.tes_env import (
    EPISODE_HOURS,
    INITIAL_ENERGY_KWH,
    N_ACTIONS,
    REWARD_SCALE,
    TERMINAL_TIMESTEP,
    QSolver,
    Series,
    StepResult,
    allowed_actions,
    business_values,
    check_energy,
    day_of,
    is_business_hour,
    scheduled_kwh,
    step,
    terminal_credit,
)

Policy = Callable[[Series, int, float], int]
# several windows decided together: [(series, t, energy) of every window] -> [action of every window]
BatchPolicy = Callable[[list[tuple[Series, int, float]]], list[int]]


def one_policy_per_window(policies: Sequence[Policy]) -> BatchPolicy:
    """The BatchPolicy that asks policies[i] for window i's action, so each window keeps its own policy's state."""
    policies = tuple(policies)

    def decide(states: list[tuple[Series, int, float]]) -> list[int]:
        return [policy(*state) for policy, state in zip(policies, states, strict=True)]

    return decide


def smallest_covering_action(need_kwh: float) -> int:
    """The lowest action whose output covers `need_kwh` (action 3 if none does)."""
    for action in range(N_ACTIONS):
        if scheduled_kwh(action) >= need_kwh - 1e-9:
            return action
    return N_ACTIONS - 1


def follow_load_policy(series: Series, t: int, energy: float) -> int:
    """The ASHP covers the load by itself (lowest output >= load); the TES only stores the surplus."""
    return smallest_covering_action(series.load[t])


def storage_first_policy(series: Series, t: int, energy: float) -> int:
    """The TES covers what it can; the ASHP adds the lowest output that covers the rest."""
    return smallest_covering_action(series.load[t] - energy)


def low_co2_charging_policy(series: Series, t: int, energy: float) -> int:
    """Full output in the day's 3 lowest-CO2 business hours (charging the TES), else storage first."""
    today = sorted(business_values(series, day_of(t), series.co2))
    if series.co2[t] <= today[2]:
        return N_ACTIONS - 1
    return storage_first_policy(series, t, energy)


def always_full_policy(series: Series, t: int, energy: float) -> int:
    """ASHP at 100% in every business hour."""
    return N_ACTIONS - 1


RULE_POLICIES: dict[str, Policy] = {
    "follow_load": follow_load_policy,
    "storage_first": storage_first_policy,
    "low_co2_charging": low_co2_charging_policy,
    "always_full": always_full_policy,
}


class RandomPolicy:
    """Uniform over the allowed actions, from its own seeded generator."""

    def __init__(self, seed: int = 0):
        self.rng = random.Random(seed)

    def __call__(self, series: Series, t: int, energy: float) -> int:
        return self.rng.choice(allowed_actions(t))


class OptimalPolicy:
    """The exact DP policy of one series (its solver memoises values across calls)."""

    def __init__(self, series: Series):
        self.solver = QSolver(series)

    def __call__(self, series: Series, t: int, energy: float) -> int:
        if series is not self.solver.series and series != self.solver.series:
            raise ValueError("OptimalPolicy was built for another series")
        return self.solver.optimal_action(t, energy)


@dataclasses.dataclass(frozen=True)
class StepRecord:
    t: int
    energy_before: float
    action: int
    result: StepResult


@dataclasses.dataclass(frozen=True)
class Episode:
    """A whole 72-hour episode. `total_reward` includes the terminal credit; net_co2_kg = -6 * it."""

    steps: tuple[StepRecord, ...]
    emissions_kg: float
    unserved_kwh: float
    wasted_kwh: float
    final_energy: float  # TES energy after the 17:00 hour of day 3
    terminal_credit: float  # in reward units
    total_reward: float

    @property
    def net_co2_kg(self) -> float:
        """Emissions + 10 kg per unserved kWh - CO2 credited for the energy left (kg)."""
        return -REWARD_SCALE * self.total_reward

    @property
    def actions(self) -> list[int]:
        """Actions at the business hours, in order."""
        return [record.action for record in self.steps if is_business_hour(record.t)]


def simulate_batch(series_list: Sequence[Series], decide: BatchPolicy,
                   initial_energy: float = INITIAL_ENERGY_KWH) -> list[Episode]:
    """Runs the 72-hour episode of every window of `series_list` in lock step, each from `initial_energy`.

    At each business hour `decide` gets every window's state (series, t, energy), in the order of `series_list`, and
    returns one action per window; outside business hours every window acts 0. Deciding all windows at once lets a
    policy batch its work across them (an LLM's prompts); no window's episode depends on another's.
    """
    energy = float(initial_energy)
    check_energy(energy)
    energies = [energy] * len(series_list)
    records: list[list[StepRecord]] = [[] for _ in series_list]
    for t in range(EPISODE_HOURS):
        if is_business_hour(t):
            actions = list(decide([(series, t, e) for series, e in zip(series_list, energies, strict=True)]))
            if len(actions) != len(series_list):
                raise ValueError(f"the policy gave {len(actions)} actions for {len(series_list)} windows at t={t}")
        else:
            actions = [0] * len(series_list)
        for i, (series, action) in enumerate(zip(series_list, actions, strict=True)):
            result = step(series, t, energies[i], action)
            records[i].append(StepRecord(t=t, energy_before=energies[i], action=action, result=result))
            energies[i] = result.energy
    return [episode_from_steps(series, steps) for series, steps in zip(series_list, records, strict=True)]


def episode_from_steps(series: Series, steps: Sequence[StepRecord]) -> Episode:
    """The totals of one window's 72 hours, with the terminal credit on the energy before hour TERMINAL_TIMESTEP."""
    final_energy = steps[TERMINAL_TIMESTEP].energy_before
    credit = terminal_credit(series, final_energy)
    return Episode(
        steps=tuple(steps),
        emissions_kg=sum(r.result.emissions_kg for r in steps),
        unserved_kwh=sum(r.result.unserved for r in steps),
        wasted_kwh=sum(r.result.wasted for r in steps),
        final_energy=final_energy,
        terminal_credit=credit,
        total_reward=sum(r.result.reward for r in steps) + credit,
    )


def simulate(series: Series, policy: Policy, initial_energy: float = INITIAL_ENERGY_KWH) -> Episode:
    """simulate_batch of the one window `series`: `policy` is asked only at business hours."""
    return simulate_batch([series], one_policy_per_window([policy]), initial_energy)[0]
