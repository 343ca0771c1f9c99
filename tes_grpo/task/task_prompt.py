"""The operator's prompt for one decision of the TES plant (tes_env.py), and the two-part text the Q datasets store.

`build_prompt(series, t, energy)` gives the (system, user) texts for the business-hour timestep t with the store at
`energy` kWh: the plant's rules and the answer format (SYSTEM_PROMPT), then the day's hourly loads and CO2 factors, the
energy left and a summary of the next day. make_q_dataset.py writes them into *_q_dataset.csv's `prompt` column as one
text (`legacy_prompt`; `parse_legacy_prompt` splits it again), convert_to_harmony.py renders them to Harmony, and
evaluate_policy.py and the tiny model's warm-up build the same prompts for the states they reach.
"""

from __future__ import annotations

from tes_grpo.task.tes_env import (
    BUSINESS_HOURS,
    CAPACITY_KWH,
    COP,
    EPISODE_DAYS,
    EPISODE_HOURS,
    FIRST_BUSINESS_HOUR,
    LAST_BUSINESS_HOUR,
    LOW_CO2_COUNT,
    RATED_KW,
    UNSERVED_PENALTY_KG_PER_KWH,
    Series,
    business_values,
    check_energy,
    day_of,
    hour_of,
    is_business_hour,
    low_co2_mean,
    scheduled_kwh,
)

SYSTEM_PROMPT = f"""You operate the cooling plant of an office building: an air-source heat pump (ASHP) that can also charge a thermal energy storage (TES) tank. Every business hour you choose the ASHP output for that hour. Goal: minimise the cumulative CO2 emissions over the whole {EPISODE_DAYS}-day horizon while serving the cooling load.

Plant
- ASHP: rated cooling output {RATED_KW:.0f} kW, constant COP {COP:.1f} (electricity = cooling output / {COP:.1f}).
- TES: capacity {CAPACITY_KWH:.0f} kWh; no standby, charging or discharging losses.
- Business hours: {FIRST_BUSINESS_HOUR:02d}:00-{LAST_BUSINESS_HOUR:02d}:00, one decision per hour ({len(BUSINESS_HOURS)} per day); the building closes at {LAST_BUSINESS_HOUR + 1:02d}:00. Outside business hours the cooling load is 0 and the ASHP is off.

What happens in an hour, in this order
1. The ASHP output serves the cooling load.
2. The TES discharges to cover the load the ASHP did not serve, as far as its energy allows.
3. Load still not covered is unserved; every unserved kWh counts as {UNSERVED_PENALTY_KG_PER_KWH:.0f} kg of CO2.
4. ASHP output above the load charges the TES up to {CAPACITY_KWH:.0f} kWh; the rest is wasted.
Emissions of the hour (kg) = ASHP output (kWh) / {COP:.1f} x the hour's CO2 factor (kg/kWh), wasted output included.

End of the horizon
The horizon ends after the {LAST_BUSINESS_HOUR:02d}:00 hour of day {EPISODE_DAYS}. Energy then left in the TES counts as CO2 saved: stored kWh / {COP:.1f} x the mean of the {LOW_CO2_COUNT} lowest CO2 factors among the next day's business hours.

Actions (ASHP output for the current hour)
[0] off: 0 kW
[1] one third: {scheduled_kwh(1):.1f} kW
[2] two thirds: {scheduled_kwh(2):.1f} kW
[3] full: {scheduled_kwh(3):.0f} kW

Answer format: a single line with only the action number in brackets, for example [2]."""  # noqa: E501 (the prompt's own line breaks)

LEGACY_SYSTEM_HEADER = "system:\n"
LEGACY_USER_HEADER = "\n\nuser:\n"


def _fmt_load(value: float) -> str:
    return f"{value:.1f}"


def _fmt_co2(value: float) -> str:
    return f"{value:.3f}"


def build_prompt(series: Series, t: int, energy: float) -> tuple[str, str]:
    """(system, user) texts for the decision at business-hour timestep t with TES energy `energy`."""
    if not (0 <= t < EPISODE_HOURS and is_business_hour(t)):
        raise ValueError(f"timestep {t} is not a business hour of the episode")
    check_energy(energy)
    day = day_of(t)
    now = series.datetimes[t]
    decision = hour_of(t) - FIRST_BUSINESS_HOUR + 1
    lines = [
        f"Current time: {now:%Y-%m-%d %H:%M}, day {day + 1} of {EPISODE_DAYS} "
        f"(decision {decision} of {len(BUSINESS_HOURS)} today).",
        f"TES energy now: {float(energy):.1f} kWh of {CAPACITY_KWH:.0f} kWh.",
        "",
        f"Today's business hours ({now:%Y-%m-%d}):",
        "hour  | load kW | CO2 kg/kWh |",
    ]
    for hour in BUSINESS_HOURS:
        s = 24 * day + hour
        mark = "past" if s < t else "NOW" if s == t else ""
        row = f"{hour:02d}:00 | {_fmt_load(series.load[s]):>7} | {_fmt_co2(series.co2[s]):>10} | {mark}"
        lines.append(row.rstrip())
    remaining = sum(series.load[s] for s in range(t, 24 * day + LAST_BUSINESS_HOUR + 1))
    lines.append(f"Load from now to the end of today: {remaining:.1f} kWh.")
    next_day = day + 1
    loads = business_values(series, next_day, series.load)
    co2s = business_values(series, next_day, series.co2)
    when = series.datetimes[24 * next_day]
    lines += [
        "",
        f"Next day ({when:%Y-%m-%d}) business hours: mean load {sum(loads) / len(loads):.1f} kW; "
        f"mean of the {LOW_CO2_COUNT} lowest CO2 factors {_fmt_co2(low_co2_mean(series, next_day))} kg/kWh; "
        f"minimum CO2 factor {_fmt_co2(min(co2s))} kg/kWh.",
    ]
    if next_day == EPISODE_DAYS:
        lines.append("The next day is after the horizon: TES energy left after 17:00 today is credited at that "
                     f"mean of the {LOW_CO2_COUNT} lowest CO2 factors.")
    lines += ["", f"Choose the action for {now:%H:%M}. Answer with a single line [k], k in 0..3."]
    return SYSTEM_PROMPT, "\n".join(lines)


def legacy_prompt(system: str, user: str) -> str:
    """The two-part text stored in the `prompt` column of *_q_dataset.csv."""
    if LEGACY_USER_HEADER in system:
        raise ValueError("the system text must not contain the user header")
    return f"{LEGACY_SYSTEM_HEADER}{system}{LEGACY_USER_HEADER}{user}"


def parse_legacy_prompt(text: str) -> tuple[str, str]:
    """Inverse of legacy_prompt; ValueError if `text` is not a two-part `system:` / `user:` prompt."""
    if not text.startswith(LEGACY_SYSTEM_HEADER):
        raise ValueError("a legacy prompt starts with 'system:' on its own line")
    body = text[len(LEGACY_SYSTEM_HEADER):]
    count = body.count(LEGACY_USER_HEADER)
    if count != 1:
        raise ValueError(f"a legacy prompt has exactly one 'user:' section after a blank line, found {count}")
    system, user = body.split(LEGACY_USER_HEADER)
    return system, user

