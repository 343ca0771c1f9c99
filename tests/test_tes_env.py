"""The TES simulator, the closed loop (episodes by hand, several windows at once), the exact DP (against brute
force), the policies, series validation and the prompt."""

from __future__ import annotations

import itertools
import math
import random
from datetime import datetime, timedelta
from fractions import Fraction

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from tes_grpo.run.fileio import InputError
from tes_grpo.task import task_prompt, tes_env, tes_policies

START = datetime(2024, 6, 3)


def make_series(co2: list[float], load: list[float], name: str = "test") -> tes_env.Series:
    datetimes = tuple(START + timedelta(hours=h) for h in range(tes_env.SERIES_HOURS))
    return tes_env.Series(name=name, datetimes=datetimes, co2=tuple(co2), load=tuple(load))


def random_series(seed: int) -> tes_env.Series:
    """Loads 0..60 kW in business hours (0 elsewhere, 0.1 kW steps), CO2 0.18..0.56 kg/kWh."""
    rng = random.Random(seed)
    co2 = [round(rng.uniform(0.18, 0.56), 3) for _ in range(tes_env.SERIES_HOURS)]
    load = [round(rng.uniform(0.0, 60.0), 1) if tes_env.is_business_hour(h) else 0.0
            for h in range(tes_env.SERIES_HOURS)]
    return make_series(co2, load)


def brute_force_best(series: tes_env.Series, t: int, energy: float) -> float:
    """Best return from timestep t by trying every action sequence (no memo, no DP)."""
    if t == tes_env.TERMINAL_TIMESTEP:
        return tes_env.terminal_credit(series, energy)
    best = -math.inf
    for action in tes_env.allowed_actions(t):
        result = tes_env.step(series, t, energy, action)
        best = max(best, result.reward + brute_force_best(series, t + 1, result.energy))
    return best


def brute_force_q(series: tes_env.Series, t: int, energy: float, action: int) -> float:
    result = tes_env.step(series, t, energy, action)
    return result.reward + brute_force_best(series, t + 1, result.energy)


# ---- one hour of the plant: (energy, load, co2, action) -> expected fields --------------------------------
TRANSITION_CASES = [
    # ASHP off, TES covers the load fully
    (150.0, 30.0, 0.4, 0,
     dict(energy=120.0, served=0.0, discharged=30.0, unserved=0.0, charged=0.0, wasted=0.0, emissions_kg=0.0)),
    # ASHP off, TES runs empty: 10 kWh unserved, reward = -(0 + 10*10)/6
    (20.0, 30.0, 0.4, 0,
     dict(energy=0.0, served=0.0, discharged=20.0, unserved=10.0, charged=0.0, wasted=0.0, emissions_kg=0.0)),
    # full output, load 30: 70 kWh surplus charges the TES; emissions 100/4*0.4 = 10 kg
    (150.0, 30.0, 0.4, 3,
     dict(energy=220.0, served=30.0, discharged=0.0, unserved=0.0, charged=70.0, wasted=0.0, emissions_kg=10.0)),
    # full output into a nearly full TES: 20 kWh charged, 50 wasted, emissions still on the full 100 kWh
    (280.0, 30.0, 0.4, 3,
     dict(energy=300.0, served=30.0, discharged=0.0, unserved=0.0, charged=20.0, wasted=50.0, emissions_kg=10.0)),
    # one third (33.33 kWh) on load 50: TES discharges the other 16.67
    (100.0, 50.0, 0.3, 1,
     dict(energy=100.0 - (50.0 - 100.0 / 3), served=100.0 / 3, discharged=50.0 - 100.0 / 3, unserved=0.0, charged=0.0,
          wasted=0.0, emissions_kg=100.0 / 3 / 4 * 0.3)),
    # two thirds on load 0 (e.g. a business hour with no load): all 66.67 kWh charged
    (0.0, 0.0, 0.5, 2,
     dict(energy=200.0 / 3, served=0.0, discharged=0.0, unserved=0.0, charged=200.0 / 3, wasted=0.0,
          emissions_kg=200.0 / 3 / 4 * 0.5)),
    # empty TES, load above the full output: 20 kWh unserved
    (0.0, 120.0, 0.2, 3,
     dict(energy=0.0, served=100.0, discharged=0.0, unserved=20.0, charged=0.0, wasted=0.0, emissions_kg=5.0)),
    # output exactly equals the load: nothing moves in the TES
    (77.0, 100.0, 0.25, 3,
     dict(energy=77.0, served=100.0, discharged=0.0, unserved=0.0, charged=0.0, wasted=0.0, emissions_kg=6.25)),
]


@pytest.mark.parametrize("energy, load, co2, action, expected", TRANSITION_CASES)
def test_transition_cases(energy, load, co2, action, expected):
    result = tes_env.transition(energy, load, co2, action)
    for field, value in expected.items():
        assert getattr(result, field) == pytest.approx(value, abs=1e-12), field
    assert result.reward == pytest.approx(-(expected["emissions_kg"] + 10 * expected["unserved"]) / 6, abs=1e-12)


@given(energy=st.floats(0.0, 300.0), load=st.floats(0.0, 200.0), co2=st.floats(0.0, 1.0),
       action=st.integers(0, 3))
def test_transition_balances_energy_and_stays_in_bounds(energy, load, co2, action):
    r = tes_env.transition(energy, load, co2, action)
    assert 0.0 <= r.energy <= tes_env.CAPACITY_KWH
    assert r.energy == pytest.approx(energy + r.charged - r.discharged, abs=1e-9)  # TES balance
    assert r.served + r.discharged + r.unserved == pytest.approx(load, abs=1e-9)  # load balance
    assert r.served + r.charged + r.wasted == pytest.approx(r.scheduled, abs=1e-9)  # ASHP output balance
    assert min(r.served, r.discharged, r.unserved, r.charged, r.wasted) >= -1e-12
    assert r.scheduled == pytest.approx(100.0 * (0, 1 / 3, 2 / 3, 1)[action])
    assert r.emissions_kg == pytest.approx(r.scheduled / 4.0 * co2)
    assert r.reward == pytest.approx(-(r.emissions_kg + 10.0 * r.unserved) / 6.0)
    assert r.charged == 0.0 or r.discharged == 0.0  # never both in one hour


@given(seed=st.integers(0, 10_000), energy=st.floats(0.0, 300.0))
@settings(max_examples=25, deadline=None)
def test_simulated_episode_keeps_energy_in_bounds_and_balanced(seed, energy):
    series = random_series(seed)
    episode = tes_policies.simulate(series, tes_policies.RandomPolicy(seed), energy)
    total_charged = sum(rec.result.charged for rec in episode.steps)
    total_discharged = sum(rec.result.discharged for rec in episode.steps)
    assert episode.steps[-1].result.energy == pytest.approx(energy + total_charged - total_discharged, abs=1e-6)
    assert all(0.0 <= rec.result.energy <= 300.0 for rec in episode.steps)
    assert all(rec.action == 0 for rec in episode.steps if not tes_env.is_business_hour(rec.t))


def test_off_business_hours_allow_only_action_0():
    series = random_series(0)
    assert tes_env.allowed_actions(7) == (0,)
    assert tes_env.allowed_actions(8) == (0, 1, 2, 3)
    assert tes_env.allowed_actions(17) == (0, 1, 2, 3)
    assert tes_env.allowed_actions(18) == (0,)
    with pytest.raises(ValueError, match="not allowed"):
        tes_env.step(series, 18, 100.0, 1)
    assert len(tes_env.business_timesteps()) == 30


def test_transition_rejects_energy_outside_the_tank():
    with pytest.raises(ValueError, match="outside"):
        tes_env.transition(300.5, 10.0, 0.3, 0)
    with pytest.raises(ValueError, match="outside"):
        tes_env.transition(-0.1, 10.0, 0.3, 0)


def test_co2_low5_uses_day_4_business_hours_only():
    co2 = [0.5] * tes_env.SERIES_HOURS
    for hour, value in zip(range(8, 18), [0.30, 0.20, 0.40, 0.10, 0.25, 0.45, 0.35, 0.50, 0.15, 0.33], strict=True):
        co2[72 + hour] = value
    co2[72 + 3] = 0.01  # a night hour of day 4 must not count
    co2[60] = 0.02  # nor a business hour of day 3
    series = make_series(co2, [0.0] * tes_env.SERIES_HOURS)
    assert tes_env.co2_low5(series) == pytest.approx((0.10 + 0.15 + 0.20 + 0.25 + 0.30) / 5)
    assert tes_env.terminal_credit(series, 120.0) == pytest.approx(0.2 * 120.0 / 4.0 / 6.0)


# ---- exact DP ------------------------------------------------------------------------------------------


class RationalDP:
    """An independent whole-episode DP in exact rational arithmetic, memoised on exact energies."""

    def __init__(self, series: tes_env.Series):
        self.load = [Fraction(x) for x in series.load]
        self.co2 = [Fraction(x) for x in series.co2]
        self.credit = Fraction(tes_env.co2_low5(series)) / 4 / 6
        self.memo: dict = {}

    def q(self, t: int, energy: Fraction, action: int) -> Fraction:
        scheduled = Fraction(100 * action, 3)
        load = self.load[t]
        unserved = max(load - scheduled - energy, Fraction(0))
        new_energy = min(max(energy + scheduled - load, Fraction(0)), Fraction(300))
        reward = -(scheduled / 4 * self.co2[t] + 10 * unserved) / 6
        return reward + self.value(t + 1, new_energy)

    def value(self, t: int, energy: Fraction) -> Fraction:
        if t == tes_env.TERMINAL_TIMESTEP:
            return self.credit * energy
        key = (t, energy)
        if key not in self.memo:
            actions = range(4) if 8 <= t % 24 <= 17 else [0]
            self.memo[key] = max(self.q(t, energy, a) for a in actions)
        return self.memo[key]


def test_q_matches_an_exact_rational_dp_over_the_whole_episode():
    series = random_series(21)
    solver = tes_env.QSolver(series)
    exact = RationalDP(series)
    assert solver.value(0, 150.0) == pytest.approx(float(exact.value(0, Fraction(150))), abs=1e-9)
    for decision in tes_env.optimal_trajectory(solver, 150.0):
        expected = [float(exact.q(decision.t, Fraction(decision.energy), a)) for a in range(4)]
        assert list(decision.q_values) == pytest.approx(expected, abs=1e-9)


@given(seed=st.integers(0, 10_000), energy=st.floats(0.0, 300.0), t=st.sampled_from([60, 61, 62, 63, 64, 65]))
@settings(max_examples=20, deadline=None)
def test_q_equals_brute_force_enumeration_on_the_last_hours(seed, energy, t):
    series = random_series(seed)
    solver = tes_env.QSolver(series)
    q = solver.q_values(t, energy)
    for action in range(4):
        assert q[action] == pytest.approx(brute_force_q(series, t, energy, action), abs=1e-9)
    assert solver.value(t, energy) == pytest.approx(max(q), abs=1e-12)


@pytest.mark.parametrize("seed", [1, 2, 3])
def test_q_equals_brute_force_from_late_day_3_with_the_shipped_initial_energy(seed):
    series = random_series(seed)
    solver = tes_env.QSolver(series)
    assert solver.q_values(60, 150.0) == pytest.approx([brute_force_q(series, 60, 150.0, a) for a in range(4)],
                                                       abs=1e-9)


@given(seed=st.integers(0, 10_000), energy=st.floats(0.0, 300.0), t=st.sampled_from([8, 17, 40, 41, 55, 59]))
@settings(max_examples=20, deadline=None)
def test_q_satisfies_bellman_equation_including_across_nights(seed, energy, t):
    series = random_series(seed)
    solver = tes_env.QSolver(series)
    q_values = solver.q_values(t, energy)
    assert [q is not None for q in q_values] == [a in tes_env.allowed_actions(t) for a in range(4)]
    for action in tes_env.allowed_actions(t):
        q = q_values[action]
        result = tes_env.step(series, t, energy, action)
        assert q == pytest.approx(result.reward + solver.value(t + 1, result.energy), abs=1e-9)
    # a night changes nothing: V before the night equals V at the next 08:00
    assert solver.value(18, energy) == pytest.approx(solver.value(32, energy), abs=1e-12)


def test_after_the_last_decision_the_value_is_the_terminal_credit():
    series = random_series(5)
    solver = tes_env.QSolver(series)
    assert solver.value(66, 123.0) == pytest.approx(tes_env.terminal_credit(series, 123.0))
    assert solver.q_values(70, 50.0) == [pytest.approx(tes_env.terminal_credit(series, 50.0)), None, None, None]


@pytest.mark.parametrize("seed", [0, 1])
def test_optimal_policy_beats_every_other_policy_and_matches_v0(seed):
    series = random_series(seed)
    solver = tes_env.QSolver(series)
    v0 = solver.value(0, 150.0)
    optimal = tes_policies.simulate(series, tes_policies.OptimalPolicy(series), 150.0)
    assert optimal.total_reward == pytest.approx(v0, abs=1e-9)
    others = [tes_policies.simulate(series, policy, 150.0) for policy in tes_policies.RULE_POLICIES.values()]
    others += [tes_policies.simulate(series, tes_policies.RandomPolicy(s), 150.0) for s in range(10)]
    assert all(episode.total_reward <= v0 + 1e-9 for episode in others)
    decisions = tes_env.optimal_trajectory(solver, 150.0)
    assert [d.t for d in decisions] == tes_env.business_timesteps()
    assert [d.action for d in decisions] == optimal.actions


def test_net_co2_is_emissions_plus_penalty_minus_credit():
    series = random_series(9)
    episode = tes_policies.simulate(series, tes_policies.RandomPolicy(3), 150.0)
    credit_kg = tes_env.co2_low5(series) * episode.final_energy / tes_env.COP
    assert episode.net_co2_kg == pytest.approx(episode.emissions_kg + 10 * episode.unserved_kwh - credit_kg)


# ---- the closed loop ---------------------------------------------------------------------------------------


def always_off(series, t, energy):
    return 0


def full_in_the_last_decision(series, t, energy):
    return 3 if t == tes_env.TERMINAL_TIMESTEP - 1 else 0


def business_load(kw: float) -> list[float]:
    return [kw if tes_env.is_business_hour(h) else 0.0 for h in range(tes_env.SERIES_HOURS)]


# days 1-3 at 0.4 kg/kWh, day 4 (which prices the energy left) at 0.2
EPISODE_CO2 = [0.4] * tes_env.EPISODE_HOURS + [0.2] * 24

# ---- whole episodes by hand: (policy, business-hour load, E0) -> expected totals --------------------------
EPISODE_CASES = {
    # 30 hours at 100 kWh x 0.4 / 4 = 300 kg; the TES fills in the 2nd hour (50 wasted), then 28 x 100 wasted;
    # 300 kWh left x 0.2 / 4 = 15 kg credited
    "full output, no load": (tes_policies.always_full_policy, 0.0, 150.0,
                             dict(emissions_kg=300.0, unserved_kwh=0.0, wasted_kwh=2850.0, final_energy=300.0,
                                  net_co2_kg=285.0)),
    # 15 hours drain the 150 kWh, the other 15 leave 10 kWh each unserved: 150 x 10 kg
    "off, 10 kW load": (always_off, 10.0, 150.0,
                        dict(emissions_kg=0.0, unserved_kwh=150.0, wasted_kwh=0.0, final_energy=0.0,
                             net_co2_kg=1500.0)),
    # the credit is paid on the energy after the 17:00 hour of day 3: 10 kg emitted, 100 x 0.2 / 4 = 5 credited
    "full only at 17:00 of day 3": (full_in_the_last_decision, 0.0, 0.0,
                                    dict(emissions_kg=10.0, unserved_kwh=0.0, wasted_kwh=0.0, final_energy=100.0,
                                         net_co2_kg=5.0)),
}


@pytest.mark.parametrize("policy, load, energy, expected", EPISODE_CASES.values(), ids=EPISODE_CASES)
def test_episode_totals_by_hand(policy, load, energy, expected):
    series = make_series(EPISODE_CO2, business_load(load))
    episode = tes_policies.simulate(series, policy, energy)
    assert len(episode.steps) == tes_env.EPISODE_HOURS and len(episode.actions) == 30
    assert {key: getattr(episode, key) for key in expected} == pytest.approx(expected, abs=1e-9)
    assert episode.total_reward == pytest.approx(sum(r.result.reward for r in episode.steps)
                                                 + episode.terminal_credit, abs=1e-12)


# ---- several windows at once: windows -> one fresh policy per window ---------------------------------------
BATCH_CASES = {
    "a different rule policy per window": lambda windows: [tes_policies.follow_load_policy,
                                                           tes_policies.storage_first_policy,
                                                           tes_policies.low_co2_charging_policy],
    "random, one stream per window": lambda windows: [tes_policies.RandomPolicy(1), tes_policies.RandomPolicy(1),
                                                      tes_policies.RandomPolicy(2)],
    "optimal": lambda windows: [tes_policies.OptimalPolicy(series) for series in windows],
}


@pytest.mark.parametrize("make_policies", BATCH_CASES.values(), ids=BATCH_CASES)
def test_simulate_batch_of_several_windows_equals_simulate_of_each(make_policies):
    windows = [random_series(seed) for seed in (4, 5, 6)]
    batch = tes_policies.simulate_batch(windows, tes_policies.one_policy_per_window(make_policies(windows)), 40.0)
    alone = [tes_policies.simulate(series, policy, 40.0) for series, policy in zip(windows, make_policies(windows),
                                                                              strict=True)]
    assert batch == alone
    assert len({episode.total_reward for episode in batch}) == len(windows)  # the windows did differ


def test_simulate_batch_asks_for_every_window_at_business_hours_only():
    windows = [random_series(7), random_series(8)]
    asked = []

    def decide(states):
        asked.append(states)
        return [tes_policies.storage_first_policy(*state) for state in states]

    episodes = tes_policies.simulate_batch(windows, decide, 100.0)
    assert [states[0][1] for states in asked] == tes_env.business_timesteps()
    for states in asked:
        t = states[0][1]
        assert states == [(series, t, episode.steps[t].energy_before)
                          for series, episode in zip(windows, episodes, strict=True)]
    assert all(r.action == 0 for episode in episodes for r in episode.steps if not tes_env.is_business_hour(r.t))


def two_actions(states):
    return [0, 0]


def action_4(states):
    return [4] * len(states)


def all_off(states):
    return [0] * len(states)


@pytest.mark.parametrize("decide, energy, message", [
    (two_actions, 150.0, "2 actions for 3 windows at t=8"),  # one action per window
    (action_4, 150.0, "action 4 is not allowed at timestep 8"),  # only 0..3
    (all_off, 300.5, "outside"),  # the tank holds 0..300 kWh
])
def test_simulate_batch_refuses(decide, energy, message):
    windows = [random_series(seed) for seed in range(3)]
    with pytest.raises(ValueError, match=message):
        tes_policies.simulate_batch(windows, decide, energy)


def test_best_action_breaks_ties_towards_the_lowest_action():
    assert tes_env.best_action([-1.0, -0.5, -0.5, -2.0]) == 1
    assert tes_env.best_action([-1.0, None, None, None]) == 0
    assert tes_env.best_action([-1.0, -1.0 + 1e-12, -3.0, -3.0]) == 0


# ---- rule policies: (policy, load, energy) -> action -------------------------------------------------------
RULE_CASES = [
    ("follow_load", 30.0, 150.0, 1),  # 33.3 covers 30
    ("follow_load", 34.0, 150.0, 2),  # 33.3 does not cover 34; 66.7 does
    ("follow_load", 0.0, 0.0, 0),  # no load, no output
    ("storage_first", 40.0, 150.0, 0),  # TES covers it all
    ("storage_first", 40.0, 10.0, 1),  # 30 short: one third covers it
    ("storage_first", 90.0, 0.0, 3),  # empty TES: full output
    ("always_full", 5.0, 290.0, 3),  # always 3
]


@pytest.mark.parametrize("name, load, energy, expected", RULE_CASES)
def test_rule_policies(name, load, energy, expected):
    loads = [0.0] * tes_env.SERIES_HOURS
    loads[10] = load
    series = make_series([0.4] * tes_env.SERIES_HOURS, loads)
    assert tes_policies.RULE_POLICIES[name](series, 10, energy) == expected


def test_low_co2_charging_charges_in_the_three_cleanest_hours():
    co2 = [0.5] * tes_env.SERIES_HOURS
    for hour, value in zip(range(8, 18), [0.45, 0.40, 0.30, 0.22, 0.20, 0.21, 0.28, 0.35, 0.42, 0.48], strict=True):
        co2[hour] = value
    series = make_series(co2, [20.0 if tes_env.is_business_hour(h) else 0.0 for h in range(96)])
    actions = [tes_policies.low_co2_charging_policy(series, t, 100.0) for t in range(8, 18)]
    assert actions == [0, 0, 0, 3, 3, 3, 0, 0, 0, 0]


# ---- series validation: (row index 0-based, column, bad text, expected message) ---------------------------
def good_rows() -> list[list[str]]:
    return [[(START + timedelta(hours=h)).isoformat(), "0.300", "25.0" if tes_env.is_business_hour(h) else "0.0"]
            for h in range(96)]


BAD_SERIES_CASES = [
    (5, 1, "abc", "row 6, column 'co2_kg_per_kwh', value 'abc': not a number"),  # non-numeric CO2
    (10, 2, "nan", "row 11, column 'cooling_load_kw', value 'nan': not finite"),  # NaN load
    (10, 2, "-1", "row 11, column 'cooling_load_kw', value '-1': cooling load must be >= 0"),  # negative load
    (3, 2, "5.0", "row 4, column 'cooling_load_kw', value '5.0': cooling load must be 0 outside"),  # night load
    (7, 0, "2024-06-03T08:30:00", "row 8, column 'datetime'"),  # not hourly
    (0, 0, "2024-06-03T01:00:00", "row 1, column 'datetime', value '2024-06-03T01:00:00': the series must start"),
    (2, 0, "yesterday", "row 3, column 'datetime', value 'yesterday': not an ISO date-time"),  # unparsable time
    (4, 1, "-0.2", "row 5, column 'co2_kg_per_kwh', value '-0.2': CO2 factor must be >= 0"),  # negative CO2
    (5, 1, "1e308", "row 6, column 'co2_kg_per_kwh', value '1e308': CO2 factor must be at most 10"),  # -inf Q before
    (5, 1, "450", "row 6, column 'co2_kg_per_kwh', value '450': CO2 factor must be at most 10 kg/kWh (is it in g/kWh"),
    (10, 2, "1000.1", "row 11, column 'cooling_load_kw', value '1000.1': cooling load must be at most 1000 kW"),
    (10, 2, "25000", "row 11, column 'cooling_load_kw', value '25000': cooling load must be at most"),  # W, not kW
]


@pytest.mark.parametrize("row, column, text, message", BAD_SERIES_CASES)
def test_series_errors_name_row_column_and_value(tmp_path, row, column, text, message):
    rows = good_rows()
    rows[row][column] = text
    path = tmp_path / "bad.csv"
    path.write_text("datetime,co2_kg_per_kwh,cooling_load_kw\n" + "\n".join(",".join(r) for r in rows) + "\n")
    with pytest.raises(InputError) as info:
        tes_env.load_series(path)
    assert str(path) in str(info.value)
    assert message in str(info.value)


def test_series_limits_are_inclusive():
    rows = good_rows()
    rows[5][1], rows[10][2] = "10", "1000"
    series = tes_env.series_from_rows(rows, "edge")
    assert series.co2[5] == 10.0 and series.load[10] == 1000.0
    assert all(math.isfinite(q) for q in tes_env.QSolver(series).q_values(8, 150.0))


@pytest.mark.parametrize("prefix", [
    b"\xef\xbb\xbf",  # Excel's "CSV UTF-8" byte-order mark: accepted
    b"",  # no mark
])
def test_series_file_encoding(tmp_path, prefix):
    path = tmp_path / "s.csv"
    path.write_bytes(prefix + ("datetime,co2_kg_per_kwh,cooling_load_kw\n"
                               + "\n".join(",".join(r) for r in good_rows()) + "\n").encode())
    assert tes_env.load_series(path).co2[0] == 0.3


# (header, the error's words)
SERIES_ERROR_CASES = [
    ("datetime,co2_kg_per_kwh,co2_kg_per_kwh", "column 'co2_kg_per_kwh': duplicate column name"),
    ("datetime,co2_kg_per_kwh,cooling_load_kw,datetime", "column 'datetime': duplicate column name"),
]


@pytest.mark.parametrize("header, words", SERIES_ERROR_CASES)
def test_series_duplicate_columns(tmp_path, header, words):
    path = tmp_path / "dup.csv"
    path.write_text(header + "\n" + "\n".join(",".join(r) for r in good_rows()) + "\n")
    with pytest.raises(InputError, match=words) as info:
        tes_env.load_series(path)
    assert str(info.value).startswith(str(path))


def test_series_invalid_utf8_names_row_and_byte(tmp_path):
    path = tmp_path / "latin1.csv"
    text = "datetime,co2_kg_per_kwh,cooling_load_kw\n" + "\n".join(",".join(r) for r in good_rows()) + "\n"
    data = text.encode()
    at = data.index(b"\n", data.index(b"T04:00:00")) - 1  # the last byte of row 5
    path.write_bytes(data[:at] + b"\xe9" + data[at + 1:])
    with pytest.raises(InputError, match=rf"row 5: not valid UTF-8 at byte {at} \(0xe9\)"):
        tes_env.load_series(path)


def test_series_needs_the_exact_columns_and_96_rows(tmp_path):
    path = tmp_path / "cols.csv"
    path.write_text("time,co2,load\n" + "\n".join(",".join(r) for r in good_rows()) + "\n")
    with pytest.raises(InputError, match="columns must be exactly datetime,co2_kg_per_kwh,cooling_load_kw"):
        tes_env.load_series(path)
    path.write_text("datetime,co2_kg_per_kwh,cooling_load_kw\n" + "\n".join(",".join(r) for r in good_rows()[:72]))
    with pytest.raises(InputError, match="exactly 96 hourly rows"):
        tes_env.load_series(path)
    path.write_text("datetime,co2_kg_per_kwh,cooling_load_kw\n" + "\n".join(",".join(r) for r in good_rows()))
    assert tes_env.load_series(path).load[8] == 25.0


# ---- prompt ------------------------------------------------------------------------------------------------


def test_prompt_marks_past_and_current_hours_and_gives_next_day_metrics():
    series = random_series(4)
    t = 24 + 11  # day 2, 11:00
    system, user = task_prompt.build_prompt(series, t, 142.25)
    assert "minimise the cumulative CO2" in system
    assert "[0] off: 0 kW" in system and "[3] full: 100 kW" in system
    assert "100 kW" in system and "COP 4.0" in system and "300 kWh" in system
    assert "Current time: 2024-06-04 11:00, day 2 of 3" in user
    assert "TES energy now: 142.2 kWh" in user or "TES energy now: 142.3 kWh" in user
    table = [line for line in user.splitlines() if line[:2].isdigit() and line[2] == ":"]
    assert len(table) == 10
    assert [line.endswith("| past") for line in table] == [True] * 3 + [False] * 7
    assert table[3].endswith("| NOW")
    assert f"{series.load[t]:>7.1f}" in table[3] and f"{series.co2[t]:.3f}" in table[3]
    next_loads = [series.load[48 + h] for h in range(8, 18)]
    next_co2 = sorted(series.co2[48 + h] for h in range(8, 18))
    assert f"mean load {sum(next_loads) / 10:.1f} kW" in user
    assert f"mean of the 5 lowest CO2 factors {sum(next_co2[:5]) / 5:.3f} kg/kWh" in user
    assert f"minimum CO2 factor {next_co2[0]:.3f} kg/kWh" in user
    assert user.rstrip().endswith("Answer with a single line [k], k in 0..3.")
    assert "after the horizon" not in user
    assert "after the horizon" in task_prompt.build_prompt(series, 60, 10.0)[1]


def test_prompt_refuses_off_business_hours():
    with pytest.raises(ValueError, match="not a business hour"):
        task_prompt.build_prompt(random_series(0), 3, 10.0)


def test_legacy_prompt_round_trips_and_rejects_malformed_text():
    series = random_series(2)
    system, user = task_prompt.build_prompt(series, 8, 150.0)
    text = task_prompt.legacy_prompt(system, user)
    assert text.startswith("system:\n") and "\n\nuser:\n" in text
    assert task_prompt.parse_legacy_prompt(text) == (system, user)
    with pytest.raises(ValueError, match="starts with 'system:'"):
        task_prompt.parse_legacy_prompt("user:\nhello")
    with pytest.raises(ValueError, match="exactly one 'user:'"):
        task_prompt.parse_legacy_prompt("system:\nhello")


def test_all_four_business_days_prompts_build_for_every_decision():
    series = random_series(3)
    prompts = {task_prompt.build_prompt(series, t, 0.0)[1] for t in tes_env.business_timesteps()}
    assert len(prompts) == 30
    assert all(len(p) < 2000 for p in prompts)


def test_brute_force_helper_enumerates_every_sequence():
    # the reference itself: from t=64 with 2 decisions it must equal an explicit loop over 16 sequences
    series = random_series(11)
    best = -math.inf
    for a, b in itertools.product(range(4), repeat=2):
        first = tes_env.step(series, 64, 75.0, a)
        second = tes_env.step(series, 65, first.energy, b)
        best = max(best, first.reward + second.reward + tes_env.terminal_credit(series, second.energy))
    assert brute_force_best(series, 64, 75.0) == pytest.approx(best, abs=1e-12)
