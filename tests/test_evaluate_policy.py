"""evaluate_policy.py: a fresh policy per window in the batched closed loop, the optimum's CO2, gaps, invalid LLM
answers, outputs, and one end-to-end run with the tiny gpt-oss and a random LoRA adapter on CPU."""

from __future__ import annotations

import functools
import math
from pathlib import Path

import pandas as pd
import pytest

import evaluate_policy as ev
from tes_grpo.model.llm_policy import Completion
from tes_grpo.task import tes_env, tes_policies
from tes_grpo.task.harmony import parse_action

REPO = Path(__file__).resolve().parents[1]
EVAL_DIR = REPO / "data" / "eval"
SERIES_DIR = REPO / "data" / "series"
PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


pytestmark = pytest.mark.usefixtures("one_torch_thread")


@pytest.fixture(scope="module")
def eval_series():
    return [tes_env.load_series(path) for path in ev.eval_windows(EVAL_DIR, SERIES_DIR)]


@pytest.fixture(scope="module")
def baseline_summary(eval_series, tmp_path_factory):
    out = tmp_path_factory.mktemp("baselines")
    summary = ev.evaluate(eval_series, ev.POLICIES, {}, out, plots=True, progress=False)
    return summary, out


def always_off(series, t, energy):
    return 0


def fixed_completions(texts: list[str], prompts: list[str], samples: int, seed: int) -> list[list[Completion]]:
    """A stand-in generate(prompts, samples, seed): sample s of every prompt is texts[s], parsed like a real one."""
    return [[Completion(text=texts[s], n_tokens=len(texts[s]), truncated=False, action=parse_action(texts[s]))
             for s in range(samples)] for _ in prompts]


def final(answer: str) -> str:
    return f"<|channel|>final<|message|>{answer}<|return|>"


def plain_render(system: str, user: str) -> str:
    return user


# ---------------------------------------------------------------------------------------------------------------
# Non-LLM policies
# ---------------------------------------------------------------------------------------------------------------

def test_eval_windows_are_the_evaluation_split():
    assert [p.name for p in ev.eval_windows(EVAL_DIR, SERIES_DIR)] == [
        "tes_2024-06-15.csv", "tes_2024-07-01.csv", "tes_2024-07-17.csv"]


def test_optimal_policy_reaches_the_dp_value(baseline_summary, eval_series):
    summary, _ = baseline_summary
    optimal = summary[summary["policy"] == "optimal"].set_index("window")
    for series in eval_series:
        value = tes_env.QSolver(series).value(0, tes_env.INITIAL_ENERGY_KWH)
        assert optimal.loc[series.name, "net_co2_kg"] == pytest.approx(-6 * value, abs=1e-9)
        assert optimal.loc[series.name, "gap_pct"] == 0.0
    assert optimal.loc["TOTAL", "net_co2_kg"] == pytest.approx(
        -6 * sum(tes_env.QSolver(s).value(0, tes_env.INITIAL_ENERGY_KWH) for s in eval_series), abs=1e-9)


def test_net_is_co2_plus_penalty_minus_credit_and_no_policy_beats_the_optimum(baseline_summary):
    summary, _ = baseline_summary
    assert set(summary["policy"]) == {"optimal", "follow_load", "storage_first", "low_co2_charging", "always_full",
                                      "random"}
    net = summary["co2_kg"] + 10 * summary["unserved_kwh"] - summary["terminal_credit_kg"]
    assert (net - summary["net_co2_kg"]).abs().max() < 1e-9
    assert (summary["gap_pct"] >= 0).all()
    assert (summary.loc[summary["policy"] == "always_full", "gap_pct"] > 0).all()
    assert summary["invalid_decisions"].isna().all()  # only LLM policies have invalid answers


def test_total_rows_add_up(baseline_summary):
    summary, _ = baseline_summary
    windows = summary[summary["window"] != "TOTAL"]
    totals = summary[summary["window"] == "TOTAL"].set_index("policy")
    for policy, group in windows.groupby("policy"):
        for column in ("co2_kg", "unserved_kwh", "terminal_credit_kg", "net_co2_kg"):
            assert totals.loc[policy, column] == pytest.approx(group[column].sum())
        assert totals.loc[policy, "decisions"] == 90
    optimum = totals.loc["optimal", "net_co2_kg"]
    random_net = totals.loc["random", "net_co2_kg"]
    assert totals.loc["random", "gap_pct"] == pytest.approx(100 * (random_net - optimum) / optimum)


def test_outputs_are_written(baseline_summary, eval_series):
    _, out = baseline_summary
    assert pd.read_csv(out / "summary.csv").shape == (4 * 6, len(ev._SUMMARY_COLUMNS))
    for series in eval_series:
        assert (out / f"{series.name}.png").read_bytes()[:8] == PNG_MAGIC
    assert not (out / "llm_decisions.csv").exists()


@pytest.mark.parametrize("net, optimum, expected", [
    (110.0, 100.0, 10.0),  # 10 % worse
    (100.0, 100.0, 0.0),  # the optimum itself
    (100.0 + 1e-12, 100.0, 0.0),  # float noise between rollout and DP value is no gap
    (-90.0, -100.0, 10.0),  # a negative optimum (credit larger than emissions): still percent above it
    (5.0, 0.0, math.nan),  # undefined
])
def test_gap_pct(net, optimum, expected):
    assert ev.gap_pct(net, optimum) == pytest.approx(expected, nan_ok=True)


@pytest.mark.parametrize("name", ev.non_llm_policy_names())
def test_every_window_starts_a_fresh_policy(baseline_summary, eval_series, name):
    # all windows run together, yet each must score as if alone: the random policy restarts its stream per window
    summary, _ = baseline_summary
    rows = summary[summary["policy"] == name].set_index("window")
    for series in eval_series:
        alone = tes_policies.simulate(series, ev.non_llm_policy(name, series, ev.RANDOM_SEED), ev.INITIAL_ENERGY)
        assert rows.loc[series.name, "net_co2_kg"] == alone.net_co2_kg
        assert rows.loc[series.name, "co2_kg"] == alone.emissions_kg


def test_unknown_policy_is_refused(capsys):
    assert ev.main(["--POLICIES=optimal,llm", "--OUT_DIR=/nonexistent/never-written"]) == 1
    assert "unknown policy 'llm'" in capsys.readouterr().err


def test_bad_series_names_the_file(tmp_path, capsys):
    bad = tmp_path / "w.csv"
    bad.write_text("datetime,co2_kg_per_kwh,cooling_load_kw\n2024-01-01T00:00,0.4,0\n")
    assert ev.main([str(bad), f"--OUT_DIR={tmp_path / 'out'}"]) == 1
    assert str(bad) in capsys.readouterr().err
    assert not (tmp_path / "out").exists()


# ---------------------------------------------------------------------------------------------------------------
# The LLM policy
# ---------------------------------------------------------------------------------------------------------------

def test_an_always_invalid_llm_acts_0_and_is_counted(eval_series, tmp_path):
    decider = ev.LLMDecider(generate=functools.partial(fixed_completions, ["I am not sure.", final("[7]")]),
                            render=plain_render, votes=2, name="llm_adapter")
    summary = ev.evaluate(eval_series[:2], ["optimal"], {"llm_adapter": decider}, tmp_path, plots=False,
                          progress=False)
    llm = summary[summary["policy"] == "llm_adapter"].set_index("window")
    for series in eval_series[:2]:
        off = tes_policies.simulate(series, always_off)
        assert llm.loc[series.name, "net_co2_kg"] == pytest.approx(off.net_co2_kg)
        assert llm.loc[series.name, "invalid_decisions"] == 30 and llm.loc[series.name, "invalid_samples"] == 60
    assert llm.loc["TOTAL", "invalid_decisions"] == 60 and llm.loc["TOTAL", "invalid_samples"] == 120
    log = pd.read_csv(tmp_path / "llm_decisions.csv")
    assert len(log) == 2 * 30 * 2 and (log["action"] == 0).all() and log["sampled_action"].isna().all()
    assert log["invalid_decision"].all()


def test_votes_pick_the_majority_and_count_invalid_samples(eval_series, tmp_path):
    texts = [final("[3]"), "no answer", final("[3]"), final("[1]")]
    decider = ev.LLMDecider(generate=functools.partial(fixed_completions, texts), render=plain_render, votes=4)
    episodes = tes_policies.simulate_batch(eval_series, decider)
    for series, episode in zip(eval_series, episodes, strict=True):
        assert episode.actions == [3] * 30
        assert episode == tes_policies.simulate(series, tes_policies.always_full_policy)
        assert decider.counts[series.name] == [30, 0, 30]
    assert decider.totals() == (90, 0, 90)


def test_llm_prompts_are_the_datasets_prompts(eval_series):
    from tes_grpo.task.harmony import load_tokenizer

    series = eval_series[0]
    frame = pd.read_csv(EVAL_DIR / f"{series.name}_q_dataset_harmony.csv")
    render = functools.partial(ev.render_prompt, load_tokenizer(), "medium", "2025-08-05")
    seen = []
    decider = ev.LLMDecider(generate=functools.partial(record_prompts, seen), render=render)
    optimal = tes_policies.OptimalPolicy(series)
    tes_policies.simulate_batch([series], functools.partial(decide_optimally, decider, optimal))
    # the LLM saw, state by state along the optimal trajectory, exactly the rows of the evaluation CSV
    assert seen == list(frame["prompt"])


def record_prompts(seen: list, prompts: list[str], samples: int, seed: int) -> list[list[Completion]]:
    seen.extend(prompts)
    return fixed_completions(["x"], prompts, samples, seed)


def decide_optimally(decider, optimal, states):
    """Asks the decider (to record its prompt) but follows the optimum, so the states are the dataset's."""
    decider(states)
    return [optimal(*state) for state in states]


def test_end_to_end_with_the_tiny_model(tmp_path, capsys):
    from test_adapter_eval import make_lora_adapter

    from tes_grpo.model.tiny_model import ensure_tiny_checkpoint

    adapter = make_lora_adapter(ensure_tiny_checkpoint(), tmp_path / "adapter", b_std=0.05)
    out = tmp_path / "eval"
    series = [str(SERIES_DIR / "tes_2024-06-15.csv"), str(SERIES_DIR / "tes_2024-07-01.csv")]
    code = ev.main([*series, f"--ADAPTER_PATH={adapter}", "--POLICIES=optimal,storage_first", "--MAX_COMPLETION_LEN=40",
                    "--TEMPERATURE=0", f"--OUT_DIR={out}", "--PROGRESS=0"])
    assert code == 0
    summary = pd.read_csv(out / "summary.csv")
    llm = summary[summary["policy"] == "llm_adapter"].set_index("window")
    assert list(llm.index) == ["tes_2024-06-15", "tes_2024-07-01", "TOTAL"]
    assert (llm["decisions"] == [30, 30, 60]).all()
    log = pd.read_csv(out / "llm_decisions.csv")
    assert len(log) == 60 and set(log["policy"]) == {"llm_adapter"}
    assert log["sampled_action"].notna().any(), "greedy answers of the warmed tiny model should parse"
    for window, group in log.groupby("window"):
        assert llm.loc[window, "invalid_decisions"] == group["invalid_decision"].sum()
        # an invalid decision was carried out as action 0; a valid one as the model's answer
        assert (group.loc[group["invalid_decision"], "action"] == 0).all()
        valid = group[~group["invalid_decision"]]
        assert (valid["action"] == valid["sampled_action"]).all()
    for name in ("tes_2024-06-15.png", "tes_2024-07-01.png"):
        assert (out / name).read_bytes()[:8] == PNG_MAGIC
    assert (out / "config.json").is_file()
    assert "llm_adapter" in capsys.readouterr().out
