"""Closed-loop evaluation: policies operate the TES plant through whole 3-day windows of the simulator.

    python evaluate_policy.py                                              # DP optimum, rule policies, random
    python evaluate_policy.py --ADAPTER_PATH=runs/grpo-gpt-oss-20b         # + the fine-tuned LLM
    python evaluate_policy.py --ADAPTER_PATH=runs/grpo-gpt-oss-20b --ALSO_BASE --VOTES=5
    python evaluate_policy.py --ADAPTER_PATH=runs/grpo-gpt-oss-20b/best    # the checkpoint that evaluated best
    python evaluate_policy.py --BASE_MODEL_ID=openai/gpt-oss-20b --MAX_COMPLETION_LEN=4000 --TEMPERATURE=1
                                                            # the base model alone (no training run to follow)
    python evaluate_policy.py data/series/tes_2024-06-15.csv               # other windows (series CSVs)

Each policy runs the 72-hour episode of `tes_env` from E = INITIAL_ENERGY kWh and is asked at every business hour.
The LLM policy sees exactly the dataset's prompt for its current state (`task_prompt.build_prompt`, rendered by
`harmony.render_harmony_prompt` with DATE and REASONING_EFFORT). MAX_COMPLETION_LEN, TEMPERATURE and the reasoning
effort follow the training run by default ("auto": train_grpo.py's train_config.json beside the adapter; the effort
falls back to the dataset's "medium" when none is recorded). With VOTES > 1 it samples that many completions and
takes the most frequent valid action (ties: the lowest). A decision with no valid answer (no `[k]` in the final
channel, or cut at MAX_COMPLETION_LEN) is carried out as action 0 and counted as invalid.
Decisions inside one window are sequential (the state depends on the last action), but all windows are decided
together: at each business hour the prompts of every window (x VOTES) go to the model in batches.

Reported per window and in total (screen, OUT_DIR/summary.csv): co2_kg (emissions), unserved_kwh, terminal_credit_kg
(CO2 credited for the energy left after 17:00 of day 3), net_co2_kg = co2 + 10 x unserved - credit (= -6 x the
episode's total reward), gap_pct = 100 x (net - net of the DP optimum) / net of the optimum, and for the LLM the
invalid decisions and invalid samples. OUT_DIR also gets <window>.png (CO2 factor, load, TES energy and actions over
time for every policy), llm_decisions.csv (every LLM sample with its state and the optimal action there) and
config.json.
"""

from __future__ import annotations

import dataclasses
import functools
import math
import sys
from pathlib import Path
from typing import Callable, Sequence

from tes_grpo.task import task_prompt, tes_env, tes_policies
from tes_grpo.task.harmony import DATASET_DATE as _DATASET_DATE

SERIES: list = []  # series CSVs to run (positional); empty = the windows of EVAL_DIR, read from SERIES_DIR
EVAL_DIR = "data/eval"  # evaluation split; its <window>_q_dataset_harmony.csv files name the default windows
SERIES_DIR = "data/series"  # where <window>.csv lives
POLICIES = ["optimal", "follow_load", "storage_first", "low_co2_charging", "always_full", "random"]  # non-LLM policies
ADAPTER_PATH = ""  # LoRA adapter folder (<run>/best: its best checkpoint); "" (and no BASE_MODEL_ID) = no LLM policy
BASE_MODEL_ID = ""  # base model folder or hub id; "" = the adapter's base. Without ADAPTER_PATH: the base is the LLM
ALSO_BASE = False  # with ADAPTER_PATH: also run the base model alone (same weights, adapter disabled, same seeds)
VOTES = 1  # completions sampled per LLM decision; the most frequent valid action is taken
MAX_COMPLETION_LEN = "auto"  # tokens per completion; auto = the training run's; a completion cut here is invalid
TEMPERATURE = "auto"  # sampling temperature; auto = the training run's; 0 = greedy
TOP_P = 1.0  # nucleus sampling mass
TOP_K = 0  # top-k sampling (0 = off)
SEED = 0  # LLM sampling seed: the generate call for business hour h, batch b uses SEED + 1000 * h + b
BATCH_SIZE = 32  # sequences per generate call (windows x votes of one hour)
REASONING_EFFORT = "auto"  # "Reasoning:" line: auto (adapter's training setting, else "medium"), low/medium/high
DATE = _DATASET_DATE  # the prompt's "Current date:" (YYYY-MM-DD; the dataset's by default)
QUANTIZED = False  # keep the MXFP4 experts quantized where the machine can (see test_lora_adapter_quantized.py)
DEVICE = "auto"  # auto (cuda when available), cpu or cuda
DTYPE = "auto"  # auto (bf16 on GPU, float32 on CPU), bfloat16, float32 or float16
ATTN_IMPLEMENTATION = "auto"  # auto (flex_attention on CUDA: it supports gpt-oss's sinks; eager on CPU) or a name
RANDOM_SEED = 0  # seed of the random policy (the same stream in every window)
INITIAL_ENERGY = 150.0  # TES energy at 00:00 of day 1 (kWh), as in the dataset
OUT_DIR = ""  # results folder; "" = runs/eval-<adapter folder name | base model name | baselines>/
PLOTS = True  # write one PNG per window
PROGRESS = True  # progress bar while the LLM decides

_KG_PER_REWARD = tes_env.REWARD_SCALE  # rewards are -(kg CO2) / 6
_SUMMARY_COLUMNS = ("window", "policy", "co2_kg", "unserved_kwh", "terminal_credit_kg", "net_co2_kg", "gap_pct",
                   "decisions", "invalid_decisions", "invalid_samples")
_TOTAL = "TOTAL"
_GAP_TOLERANCE_KG = 1e-9  # net CO2 this close to the optimum's is a gap of exactly 0
_HOUR_SEED_STRIDE = 1000  # seeds of different business hours never overlap while an hour has < 1000 batches


# ---------------------------------------------------------------------------------------------------------------
# Windows
# ---------------------------------------------------------------------------------------------------------------

def eval_windows(eval_dir: str | Path, series_dir: str | Path) -> list[Path]:
    """Series CSVs of the evaluation split's windows (<window>_q_dataset_harmony.csv -> <series_dir>/<window>.csv)."""
    from tes_grpo.run.fileio import InputError

    suffix = "_q_dataset_harmony"
    files = sorted(Path(eval_dir).glob(f"*{suffix}.csv"))
    if not files:
        raise InputError(eval_dir, f"no *{suffix}.csv files: build the evaluation split or pass series CSVs")
    paths = []
    for file in files:
        path = Path(series_dir) / f"{file.stem.removesuffix(suffix)}.csv"
        if not path.is_file():
            raise InputError(path, f"series of {file.name} not found (SERIES_DIR={series_dir})")
        paths.append(path)
    return paths


# ---------------------------------------------------------------------------------------------------------------
# Closed loop, all windows in lockstep
# ---------------------------------------------------------------------------------------------------------------

def episodes_by_window(series_list: Sequence[tes_env.Series], decide: tes_policies.BatchPolicy,
                       initial_energy: float = tes_env.INITIAL_ENERGY_KWH) -> dict[str, tes_policies.Episode]:
    """tes_policies.simulate_batch of every window under `decide`, keyed by window name."""
    episodes = tes_policies.simulate_batch(series_list, decide, initial_energy)
    return {series.name: episode for series, episode in zip(series_list, episodes, strict=True)}


@dataclasses.dataclass
class LLMDecider:
    """BatchPolicy that asks the LLM: one prompt per window state, `votes` samples each, majority vote, invalid -> 0.

    generate(prompts, samples, seed) -> one list of `samples` llm_policy.Completion per prompt.
    render(system, user) -> the Harmony prompt text.
    """

    generate: Callable
    render: Callable
    votes: int = 1
    seed: int = 0
    name: str = "llm"
    counts: dict = dataclasses.field(default_factory=dict)  # window -> [decisions, invalid decisions, invalid samples]
    log: list = dataclasses.field(default_factory=list)
    progress: object = None  # a tqdm bar advanced once per business hour

    def totals(self) -> tuple[int, int, int]:
        """(decisions, invalid decisions, invalid samples) over all windows."""
        return tuple(sum(c[i] for c in self.counts.values()) for i in range(3))

    def __call__(self, states: list) -> list[int]:
        from tes_grpo.model.llm_policy import majority_vote

        prompts = [self.render(*task_prompt.build_prompt(series, t, energy)) for series, t, energy in states]
        hour_index = tes_env.business_timesteps().index(states[0][1])
        completions = self.generate(prompts, self.votes, self.seed + _HOUR_SEED_STRIDE * hour_index)
        actions = []
        for (series, t, energy), samples in zip(states, completions, strict=True):
            sampled = [c.action for c in samples]
            vote = majority_vote(sampled)
            action = 0 if vote is None else vote
            counts = self.counts.setdefault(series.name, [0, 0, 0])
            counts[0] += 1
            counts[1] += vote is None
            counts[2] += sum(a is None for a in sampled)
            for sample, completion in enumerate(samples):
                self.log.append({"policy": self.name, "window": series.name, "t": t,
                                 "timestamp": series.datetimes[t].isoformat(timespec="minutes"),
                                 "energy_kwh": energy, "sample": sample, "sampled_action": completion.action,
                                 "truncated": completion.truncated, "n_tokens": completion.n_tokens,
                                 "action": action, "invalid_decision": vote is None,
                                 "completion": completion.text})
            actions.append(action)
        if self.progress is not None:
            self.progress.set_postfix(invalid=self.totals()[1], refresh=False)
            self.progress.update(1)
        return actions


# ---------------------------------------------------------------------------------------------------------------
# Results
# ---------------------------------------------------------------------------------------------------------------

def episode_metrics(episode: tes_policies.Episode) -> dict:
    credit_kg = _KG_PER_REWARD * episode.terminal_credit
    return {"co2_kg": episode.emissions_kg, "unserved_kwh": episode.unserved_kwh, "terminal_credit_kg": credit_kg,
            "net_co2_kg": episode.net_co2_kg}


def gap_pct(net: float, optimum: float) -> float:
    """Percent above the optimum's net CO2 (NaN when the optimum's net is 0)."""
    if optimum == 0:
        return math.nan
    if abs(net - optimum) <= _GAP_TOLERANCE_KG:
        return 0.0  # float-rounding differences between the rollout and the DP value, not a gap
    return 100.0 * (net - optimum) / abs(optimum)


def summary_rows(episodes: dict[str, dict[str, tes_policies.Episode]], optimum: dict[str, float],
                 deciders: dict[str, LLMDecider]) -> list[dict]:
    """Rows of summary.csv: every (window, policy), then a TOTAL row per policy.

    episodes[policy][window]; optimum[window] = the DP optimum's net CO2; deciders: the LLM policies by name, whose
    invalid decisions and samples are reported (empty cells for the other policies).
    """
    rows = []
    windows = list(optimum)
    for window in windows:
        for policy, by_window in episodes.items():
            episode = by_window[window]
            metrics = episode_metrics(episode)
            counts = deciders[policy].counts.get(window, [0, 0, 0]) if policy in deciders else [None] * 3
            rows.append({"window": window, "policy": policy, **metrics,
                         "gap_pct": gap_pct(metrics["net_co2_kg"], optimum[window]),
                         "decisions": len(episode.actions), "invalid_decisions": counts[1],
                         "invalid_samples": counts[2]})
    total_optimum = sum(optimum.values())
    for policy, by_window in episodes.items():
        metrics = [episode_metrics(by_window[w]) for w in windows]
        totals = {key: sum(m[key] for m in metrics) for key in metrics[0]}
        counts = deciders[policy].totals() if policy in deciders else [None] * 3
        rows.append({"window": _TOTAL, "policy": policy, **totals,
                     "gap_pct": gap_pct(totals["net_co2_kg"], total_optimum),
                     "decisions": sum(len(by_window[w].actions) for w in windows),
                     "invalid_decisions": counts[1], "invalid_samples": counts[2]})
    return rows


def format_summary(frame) -> str:
    table = frame.copy()
    for column in ("co2_kg", "unserved_kwh", "terminal_credit_kg", "net_co2_kg"):
        table[column] = [f"{v:.2f}" for v in table[column]]
    table["gap_pct"] = ["n/a" if math.isnan(v) else f"{v:+.2f}%" for v in table["gap_pct"]]
    for column in ("invalid_decisions", "invalid_samples"):
        table[column] = ["" if v is None or (isinstance(v, float) and math.isnan(v)) else str(int(v))
                         for v in table[column]]
    return table.to_string(index=False)


def plot_window(series: tes_env.Series, episodes: dict[str, tes_policies.Episode], path: str | Path,
                invalid: dict[str, set[int]] | None = None) -> Path:
    """PNG of one window: CO2 factor, load, TES energy and actions over the 72 hours, one line per policy.

    invalid[policy] = the timesteps where that (LLM) policy gave no valid answer; they are marked with a red x.
    """
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import numpy as np

    from tes_grpo.run.fileio import atomic_output

    hours = np.arange(tes_env.EPISODE_HOURS + 1)
    fig, axes = plt.subplots(4, 1, figsize=(13, 10), sharex=True, layout="constrained",
                             gridspec_kw={"height_ratios": [1, 1, 1.6, 0.18 * len(episodes) + 0.4]})
    co2 = list(series.co2[:tes_env.EPISODE_HOURS])
    load = list(series.load[:tes_env.EPISODE_HOURS])
    axes[0].stairs(co2, hours, color="tab:gray")
    axes[0].set_ylabel("CO2 factor\nkg/kWh")
    axes[1].stairs(load, hours, color="tab:blue", fill=True, alpha=0.5)
    axes[1].set_ylabel("cooling load\nkW")
    for name, episode in episodes.items():
        energy = [r.energy_before for r in episode.steps] + [episode.steps[-1].result.energy]
        axes[2].plot(hours, energy, label=f"{name} (net {episode.net_co2_kg:.1f} kg)",
                     linewidth=2.2 if name == "optimal" else 1.2)
    axes[2].set_ylabel("TES energy\nkWh")
    axes[2].set_ylim(-5, tes_env.CAPACITY_KWH + 5)
    axes[2].legend(fontsize=8, loc="upper left", bbox_to_anchor=(1.01, 1.0))
    for axis in axes[:3]:
        axis.axvline(tes_env.TERMINAL_TIMESTEP, color="black", linestyle=":", linewidth=1)
    axes[2].annotate("end of horizon:\nenergy left credited", (tes_env.TERMINAL_TIMESTEP, tes_env.CAPACITY_KWH),
                     xytext=(-4, -4), textcoords="offset points", ha="right", va="top", fontsize=8)
    grid = np.full((len(episodes), tes_env.EPISODE_HOURS), np.nan)
    for row, episode in enumerate(episodes.values()):
        for record in episode.steps:
            if tes_env.is_business_hour(record.t):
                grid[row, record.t] = record.action
    image = axes[3].imshow(grid, aspect="auto", interpolation="nearest", cmap="viridis", vmin=0,
                           vmax=tes_env.N_ACTIONS - 1, extent=(0, tes_env.EPISODE_HOURS, len(episodes), 0))
    marks = [(t + 0.5, row + 0.5) for row, name in enumerate(episodes) for t in sorted((invalid or {}).get(name, ()))]
    if marks:
        axes[3].scatter(*zip(*marks, strict=True), marker="x", color="red", s=18,
                        label="invalid answer (action 0 ran)")
        axes[3].legend(fontsize=8, loc="upper left", bbox_to_anchor=(1.01, 1.0))
    axes[3].set_yticks(np.arange(len(episodes)) + 0.5, list(episodes), fontsize=8)
    axes[3].set_xlabel(f"hour from {series.datetimes[0]:%Y-%m-%d} 00:00")
    axes[3].set_xticks(range(0, tes_env.EPISODE_HOURS + 1, 6))
    colorbar = fig.colorbar(image, ax=axes[3], location="right", ticks=range(tes_env.N_ACTIONS), pad=0.01)
    colorbar.set_label("action")
    fig.suptitle(f"{series.name}: {tes_env.EPISODE_DAYS}-day closed loop from E0 = "
                 f"{episodes[next(iter(episodes))].steps[0].energy_before:.0f} kWh")
    path = Path(path)
    with atomic_output(path, suffix=".png") as tmp:
        fig.savefig(tmp, dpi=110, format="png")
    plt.close(fig)
    return path


# ---------------------------------------------------------------------------------------------------------------
# Running it
# ---------------------------------------------------------------------------------------------------------------

def non_llm_policy_names() -> list[str]:
    return ["optimal", *tes_policies.RULE_POLICIES, "random"]


def check_policy_names(names: Sequence[str]) -> None:
    """ValueError naming the first unknown policy (the LLM is not one: it runs when a model is given)."""
    for name in names:
        if name not in non_llm_policy_names():
            raise ValueError(f"unknown policy {name!r} in POLICIES; choose from {', '.join(non_llm_policy_names())} "
                             "(the LLM policy runs when ADAPTER_PATH or BASE_MODEL_ID is set)")


def non_llm_policy(name: str, series: tes_env.Series, random_seed: int) -> tes_policies.Policy:
    """A fresh policy for one window (the random policy restarts its stream in every window)."""
    check_policy_names([name])
    if name == "optimal":
        return tes_policies.OptimalPolicy(series)
    if name == "random":
        return tes_policies.RandomPolicy(random_seed)
    return tes_policies.RULE_POLICIES[name]


def generate_decisions(policy_model, use_adapter: bool, max_new_tokens: int, temperature: float, top_p: float,
                       top_k: int, batch_size: int, prompts: list[str], samples: int, seed: int) -> list:
    """LLMDecider's generate(prompts, samples, seed) once the settings are bound with functools.partial."""
    from tes_grpo.model.llm_policy import generate

    return generate(policy_model, prompts, samples, seed, max_new_tokens, temperature, top_p, top_k, batch_size,
                    use_adapter=use_adapter, progress=False)


def render_prompt(tokenizer, reasoning_effort: str, date: str, system: str, user: str) -> str:
    """LLMDecider's render(system, user) once tokenizer and settings are bound with functools.partial."""
    from tes_grpo.task.harmony import render_harmony_prompt

    return render_harmony_prompt(system, user, tokenizer, reasoning_effort, date)


def default_out_dir(adapter_path: str, base_model_id: str) -> Path:
    if adapter_path:
        from tes_grpo.run.adapter_folder import adapter_run_name

        name = adapter_run_name(adapter_path)
    elif base_model_id:
        name = Path(base_model_id).name
    else:
        name = "baselines"
    return Path("runs") / f"eval-{name}"


def evaluate(series_list: Sequence[tes_env.Series], policies: Sequence[str], llm_deciders: dict[str, LLMDecider],
             out_dir: str | Path, initial_energy: float = INITIAL_ENERGY, random_seed: int = RANDOM_SEED,
             plots: bool = PLOTS, progress: bool = PROGRESS):
    """Runs every policy through all windows (tes_policies.simulate_batch), writes summary.csv (+ PNGs,
    llm_decisions.csv); returns the summary.

    The DP optimum always runs, first (the gaps need it); `llm_deciders` maps policy names to LLMDeciders.
    """
    import pandas as pd
    from tqdm import tqdm

    from tes_grpo.run.fileio import write_csv_atomic

    check_policy_names(policies)
    names = [s.name for s in series_list]
    if len(set(names)) != len(names):
        raise ValueError(f"two series share a window name: {', '.join(names)}")
    episodes: dict[str, dict[str, tes_policies.Episode]] = {}
    for name in ["optimal", *[p for p in policies if p != "optimal"]]:
        decide = tes_policies.one_policy_per_window([non_llm_policy(name, s, random_seed) for s in series_list])
        episodes[name] = episodes_by_window(series_list, decide, initial_energy)
    solvers = {s.name: tes_env.QSolver(s) for s in series_list}
    optimum = {s.name: -_KG_PER_REWARD * solvers[s.name].value(0, initial_energy) for s in series_list}
    for name, decider in llm_deciders.items():
        steps = len(tes_env.business_timesteps())
        with tqdm(total=steps, desc=f"{name} decisions ({len(series_list)} windows x {decider.votes} votes)",
                  unit="hour", disable=not progress) as bar:
            decider.progress = bar
            episodes[name] = episodes_by_window(series_list, decider, initial_energy)
            decider.progress = None
    rows = summary_rows(episodes, optimum, llm_deciders)
    summary = pd.DataFrame(rows, columns=list(_SUMMARY_COLUMNS))
    out_dir = Path(out_dir)
    write_csv_atomic(summary, out_dir / "summary.csv")
    if llm_deciders:
        log = pd.DataFrame([entry for d in llm_deciders.values() for entry in d.log])
        log.insert(log.columns.get_loc("action") + 1, "optimal_action",
                   [solvers[w].optimal_action(t, e)
                    for w, t, e in zip(log["window"], log["t"], log["energy_kwh"], strict=True)])
        log["sampled_action"] = log["sampled_action"].astype("Int64")
        write_csv_atomic(log, out_dir / "llm_decisions.csv")
    if plots:
        for series in series_list:
            invalid = {name: {e["t"] for e in d.log if e["window"] == series.name and e["invalid_decision"]}
                       for name, d in llm_deciders.items()}
            plot_window(series, {name: by_window[series.name] for name, by_window in episodes.items()},
                        out_dir / f"{series.name}.png", invalid)
    return summary


def build_llm_deciders(s) -> dict:
    """{policy name: LLMDecider} for settings s: "llm_adapter" (and "llm_base" with ALSO_BASE), or "llm_base"
    without an adapter."""
    from tes_grpo.model.llm_policy import load_policy_model

    if not s.ADAPTER_PATH and not s.BASE_MODEL_ID:
        return {}
    if s.VOTES < 1:
        raise ValueError("VOTES must be >= 1")
    from tes_grpo.run.adapter_folder import checked_training_settings, from_training_run
    from tes_grpo.task.harmony import DATASET_REASONING_EFFORT, check_date

    check_date(s.DATE)
    sampling = checked_training_settings(s, ("MAX_COMPLETION_LEN", "TEMPERATURE"), s.ADAPTER_PATH)
    effort, origin = from_training_run("REASONING_EFFORT", s.REASONING_EFFORT, s.ADAPTER_PATH,
                                       DATASET_REASONING_EFFORT)
    effort = effort or DATASET_REASONING_EFFORT  # "" (train_grpo's "keep the CSV's") means the dataset's effort
    policy_model = load_policy_model(s.BASE_MODEL_ID, s.ADAPTER_PATH, quantized=s.QUANTIZED, device=s.DEVICE,
                                     dtype=s.DTYPE, attn_implementation=s.ATTN_IMPLEMENTATION)
    print(f"LLM: {policy_model.base_model_id}" + (f" + adapter {s.ADAPTER_PATH}" if s.ADAPTER_PATH else "")
          + f"; experts: {policy_model.experts}; {policy_model.device}, {policy_model.dtype}, attention "
          f"{policy_model.attention}; {s.VOTES} vote(s); reasoning effort {effort} ({origin})")
    render = functools.partial(render_prompt, policy_model.tokenizer, effort, s.DATE)
    variants = [("llm_adapter", True)] + ([("llm_base", False)] if s.ALSO_BASE else []) if s.ADAPTER_PATH \
        else [("llm_base", False)]
    return {name: LLMDecider(generate=functools.partial(generate_decisions, policy_model, use_adapter,
                                                        sampling["MAX_COMPLETION_LEN"], sampling["TEMPERATURE"],
                                                        s.TOP_P, s.TOP_K, s.BATCH_SIZE),
                             render=render, votes=s.VOTES, seed=s.SEED, name=name)
            for name, use_adapter in variants}


def main(argv: list[str] | None = None) -> int:
    from tes_grpo.run.adapter_folder import resolve_adapter_path
    from tes_grpo.run.fileio import InputError
    from tes_grpo.run.script_config import resolve, save_config

    s = resolve(globals(), argv, positional="SERIES")
    try:
        s = s.replace(ADAPTER_PATH=resolve_adapter_path(s.ADAPTER_PATH, print))  # <run>/best: the best checkpoint
        series_paths = list(s.SERIES) or eval_windows(s.EVAL_DIR, s.SERIES_DIR)
        series_list = [tes_env.load_series(path) for path in series_paths]  # bad input fails before the model loads
        check_policy_names(s.POLICIES)
        out_dir = Path(s.OUT_DIR) if s.OUT_DIR else default_out_dir(s.ADAPTER_PATH, s.BASE_MODEL_ID)
        deciders = build_llm_deciders(s)
        summary = evaluate(series_list, s.POLICIES, deciders, out_dir, s.INITIAL_ENERGY, s.RANDOM_SEED, s.PLOTS,
                           s.PROGRESS)
    except (InputError, ValueError) as err:
        print(f"error: {err}", file=sys.stderr)
        return 1
    save_config(s, out_dir / "config.json")
    print(format_summary(summary))
    print("\nnet_co2_kg = co2 + 10 x unserved - terminal credit; gap = percent above the DP optimum's net; "
          "an invalid LLM decision was carried out as action 0")
    print(f"wrote {out_dir}/summary.csv" + (f", {len(series_paths)} PNG(s)" if s.PLOTS else "")
          + (", llm_decisions.csv" if deciders else ""))
    return 0


if __name__ == "__main__":
    sys.exit(main())
