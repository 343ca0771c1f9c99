"""Training data and reward for GRPO on the TES task: load and check the Harmony CSVs, score completions.

    .venv/bin/python data_reward.py runs/grpo-tiny/completions.csv   # re-score a completion log, print the summary

The summary also gives the sampler-trainer gap the run logged (metrics.jsonl beside the log; sampling_fidelity.py).

Imported by train_grpo.py (and run on its own to re-score a completion log with today's parser). The pieces:

- `load_training_frames(data_dir, eval_dir)`: every `*_harmony.csv` under `data_dir` except those under
  `eval_dir`, columns checked (errors name file, row, column and value).
- `check_prompt_lengths(...)`: prompts longer than the token limit fail (naming file and row) or are skipped
  with a printed count; never cut, which would drop the Harmony header. Adds each prompt's token count.
- `load_eval_frame(eval_dir)`: the evaluation split's rows, checked the same way, with their exact Q-values; the
  rows train_grpo.py evaluates during training (run/evaluation.py).
- `reward_fn(completions, reward_action_0, ..., reward_action_3, *, invalid_reward, **kwargs)`: TRL reward
  function; the row's `reward_action_<k>` for the action k parsed from the final channel (harmony.parse_action),
  `invalid_reward` when the completion has no valid final answer or was cut at the length limit. train_grpo.py
  binds `invalid_reward=INVALID_REWARD` and its `CompletionLog` with `bind_reward` (a partial, as open-r1 binds
  reward parameters). It also logs test_lora_adapter.py's quantities, which TRL names eval_... in evaluation.

Completion log (`CompletionLog`, written by the bound reward function while training): columns step, micro_step,
prompt, completion, action, reward, truncated, target_action, rank (the process that generated the row; 0 on one
GPU). Evaluation completions (rows marked by run/evaluation.py) are left out: the log holds training steps only.
On several processes every rank's rows are gathered to rank 0, which alone writes; rows are appended (a resumed run
continues the file) and the file is closed after every batch.
"""

from __future__ import annotations

import csv
import dataclasses
import functools
import itertools
import math
import os
import sys
from pathlib import Path

import pandas as pd

from tes_grpo.run.evaluation import EVAL_SPLIT, SPLIT_COLUMN
from tes_grpo.run.fileio import InputError, parse_finite, parse_whole, read_csv_table
from tes_grpo.run.processes import gather_on_main, process_rank, say
from tes_grpo.task.harmony import (
    HARMONY_GLOB,
    harmony_csv_files,
    is_truncated,
    load_tokenizer,
    parse_action,
    prompt_problem,
    set_reasoning_effort,
)
from tes_grpo.task.tes_env import N_ACTIONS as NUM_ACTIONS  # the plant decides how many actions there are
from tes_grpo.task.tes_env import Q_COLUMNS, REWARD_COLUMNS, reward_problems

# The columns training reads from a dataset row, which StepStream hands to TRL; TRL passes every column but `prompt`
# to reward_fn as a keyword list.
RECORD_COLUMNS = ["prompt", "optimal_action", *REWARD_COLUMNS]
EVAL_RECORD_COLUMNS = [*RECORD_COLUMNS, *Q_COLUMNS]  # an evaluation row also has the exact Q-values (the regret)
LOG_COLUMNS = ["step", "micro_step", "prompt", "completion", "action", "reward", "truncated", "target_action", "rank"]


# ---------------------------------------------------------------------------------------------------------------
# Loading and checking the training CSVs
# ---------------------------------------------------------------------------------------------------------------

_REWARD_HINT = " (calculate_reward.py computes the rewards from the Q-values)"


def check_frame(frame: pd.DataFrame, path: str | os.PathLike) -> pd.DataFrame:
    """Checks one training CSV's columns and values; returns the checked columns with parsed dtypes.

    Rows are numbered from 1 for the first data row (the header is not counted); prompts hold newlines, so
    CSV records and file lines differ.
    """
    missing = [column for column in RECORD_COLUMNS if column not in frame.columns]
    if missing:
        raise InputError(path, f"missing column(s) {', '.join(missing)}; found {', '.join(map(str, frame.columns))}")
    if len(frame) == 0:
        raise InputError(path, "no data rows")
    checked = {}
    prompts = []
    for row, value in enumerate(frame["prompt"], start=1):
        problem = prompt_problem(value)
        if problem is not None:
            raise InputError(path, problem, row=row, column="prompt",
                             value=value[:80] if isinstance(value, str) else value)
        prompts.append(value)
    checked["prompt"] = prompts
    actions = [parse_whole(path, row, "optimal_action", value, 0, NUM_ACTIONS - 1, what="optimal_action")
               for row, value in enumerate(frame["optimal_action"], start=1)]
    checked["optimal_action"] = actions
    for column in REWARD_COLUMNS:
        checked[column] = [parse_finite(path, row, column, value, what="reward", hint=_REWARD_HINT)
                           for row, value in enumerate(frame[column], start=1)]
    for row, rewards in enumerate(zip(*(checked[column] for column in REWARD_COLUMNS), strict=True), start=1):
        problems = reward_problems(rewards)  # check_data.py's rule
        if problems:
            action, why = problems[0]
            column = "reward_action_0..3" if action is None else REWARD_COLUMNS[action]
            raise InputError(path, why + _REWARD_HINT, row=row, column=column,
                             value=None if action is None else frame[column].iloc[row - 1])
    result = pd.DataFrame(checked)
    result["source"] = [f"{Path(path).name}:{row}" for row in range(1, len(result) + 1)]
    return result


def load_training_frames(data_dir: str | os.PathLike, eval_dir: str | os.PathLike | None) -> pd.DataFrame:
    """All training rows (every `*_harmony.csv` under data_dir, eval_dir left out), checked, in one frame.

    Columns: prompt, optimal_action, reward_action_0..3 and `source` ("<file>:<row>", for messages).
    Raises InputError naming the file, row, column and value of the first bad cell.
    """
    paths = harmony_csv_files(data_dir, eval_dir)
    if not paths:
        raise InputError(data_dir, f"no training files matching {HARMONY_GLOB} (outside {eval_dir}); "
                         "build the datasets with the data pipeline first")
    return pd.concat([check_frame(read_csv_table(path), path) for path in paths], ignore_index=True)


def check_q_columns(raw: pd.DataFrame, path) -> dict[str, list[float]]:
    """The q_action_0..3 columns as floats; InputError naming file, row (first data row = 1), column and value."""
    missing = [column for column in Q_COLUMNS if column not in raw.columns]
    if missing:
        raise InputError(path, f"missing column(s) {', '.join(missing)} (the exact Q-values of make_q_dataset.py)")
    return {column: [parse_finite(path, row, column, value, what="Q-value")
                     for row, value in enumerate(raw[column], start=1)] for column in Q_COLUMNS}


def load_eval_frame(eval_dir: str | os.PathLike) -> pd.DataFrame:
    """The evaluation split's rows (every `*_harmony.csv` under eval_dir), checked as training rows are, with the
    exact Q-values q_action_0..3. InputError naming EVAL_DIR when it is missing or holds no such file."""
    folder = Path(eval_dir)
    if not folder.is_dir():
        raise InputError(folder, "EVAL_DIR does not exist (the evaluation split, evaluated every EVAL_STEPS); build "
                         "the datasets with the data pipeline, point EVAL_DIR at the split, or set EVAL_STEPS=0")
    paths = harmony_csv_files(folder)
    if not paths:
        raise InputError(folder, f"EVAL_DIR has no {HARMONY_GLOB} files (the evaluation split, evaluated every "
                         "EVAL_STEPS); build the datasets with the data pipeline, or set EVAL_STEPS=0")
    frames = []
    for path in paths:
        raw = read_csv_table(path)
        frames.append(check_frame(raw, path).assign(**check_q_columns(raw, path)))
    return pd.concat(frames, ignore_index=True)


def apply_reasoning_effort(frame: pd.DataFrame, effort: str) -> pd.DataFrame:
    """Copy of the frame with every prompt's reasoning effort set; errors name the row's source."""
    prompts = []
    for prompt, source in zip(frame["prompt"], frame["source"], strict=True):
        try:
            prompts.append(set_reasoning_effort(prompt, effort))
        except ValueError as err:
            file, _, row = source.rpartition(":")
            raise InputError(file, str(err), row=int(row), column="prompt", value=prompt[:80]) from None
    result = frame.copy()
    result["prompt"] = prompts
    return result


def check_prompt_lengths(frame: pd.DataFrame, tokenizer, max_prompt_len: int,
                         on_too_long: str = "error") -> pd.DataFrame:
    """Rows whose prompt fits in max_prompt_len tokens; the others fail or are skipped (with a printed count).

    on_too_long: "error" raises InputError naming the first long row's file and row; "skip" drops long rows
    and prints how many. Prompts are never cut: that would drop the Harmony header.
    """
    if on_too_long not in ("error", "skip"):
        raise ValueError(f"on_too_long must be 'error' or 'skip', got {on_too_long!r}")
    lengths = [len(ids) for ids in tokenizer(list(frame["prompt"]), add_special_tokens=False)["input_ids"]]
    too_long = [i for i, n in enumerate(lengths) if n > max_prompt_len]
    if too_long and on_too_long == "error":
        first = too_long[0]
        file, _, row = frame["source"].iloc[first].rpartition(":")
        raise InputError(file, f"prompt has {lengths[first]} tokens, more than MAX_PROMPT_LEN={max_prompt_len} "
                         f"({len(too_long)} such row(s) in all); raise MAX_PROMPT_LEN or set "
                         "PROMPT_TOO_LONG=skip", row=int(row), column="prompt")
    if too_long:
        say(f"skipped {len(too_long)} of {len(frame)} prompts longer than MAX_PROMPT_LEN={max_prompt_len} tokens")
    kept = frame.assign(prompt_tokens=lengths).drop(index=frame.index[too_long]).reset_index(drop=True)
    if len(kept) == 0:
        raise InputError("training data", f"every prompt is longer than MAX_PROMPT_LEN={max_prompt_len} tokens")
    say(f"prompt lengths: {min(lengths)}..{max(lengths)} tokens, {len(kept)} prompts kept")
    return kept


# ---------------------------------------------------------------------------------------------------------------
# Reading completions and scoring them
# ---------------------------------------------------------------------------------------------------------------

def decode_with_special_tokens(ids: list[int]) -> str:
    """Completion ids as text with the Harmony markers kept (TRL's own decode drops them)."""
    return load_tokenizer().decode(list(ids), skip_special_tokens=False)


def _message_text(message, index: int) -> str:
    """The text of one conversational message: content a string or a list of text parts ({"type": "text", ...})."""
    content = message.get("content") if isinstance(message, dict) else None
    if isinstance(content, str):
        return content
    if isinstance(content, list) and all(isinstance(part, dict) and isinstance(part.get("text"), str)
                                         for part in content):
        return "".join(part["text"] for part in content)
    raise TypeError(f"completion message {index} is {_shape(message)}; expected {{'role': ..., 'content': str or "
                    "a list of {'type': 'text', 'text': str} parts}")


def _shape(value) -> str:
    if isinstance(value, dict):
        return "a dict with " + ("content " + _shape(value["content"]) if "content" in value else "no 'content'")
    if isinstance(value, (list, tuple)):
        return f"a {type(value).__name__} of {len(value)} item(s)"
    return f"a {type(value).__name__} ({value!r:.40})"


def completion_text(completion, ids: list[int] | None) -> str:
    """The completion as Harmony text: decoded from its ids when TRL passed them, else the given text.

    TRL passes either plain text or, for conversational datasets, a list of {"role", "content"} messages; anything
    else is a TypeError naming the shape it got (never an error from deep inside the parser).
    """
    if ids is not None:
        return decode_with_special_tokens(ids)
    if isinstance(completion, str):
        return completion
    if isinstance(completion, list):
        return "".join(_message_text(message, i) for i, message in enumerate(completion))
    raise TypeError(f"a completion must be a string or a list of messages; got {_shape(completion)}")


def score_completion(text: str, ids: list[int] | None, rewards: list[float],
                     invalid_reward: float) -> tuple[int | None, float]:
    """(action, reward) for one completion; `invalid_reward` when the action is invalid or generation was cut."""
    if is_truncated(ids):
        return None, invalid_reward  # cut at MAX_COMPLETION_LEN: the model never finished its answer
    action = parse_action(text)
    if action is None:
        return None, invalid_reward
    return action, float(rewards[action])


def reward_fn(completions, reward_action_0, reward_action_1, reward_action_2, reward_action_3,
              completion_ids=None, prompts=None, optimal_action=None, trainer_state=None, log_metric=None, *,
              invalid_reward: float, completion_log: CompletionLog | None = None, **kwargs) -> list[float]:
    """TRL reward function: the completion's row reward for its parsed action; `invalid_reward` when it is invalid
    or truncated.

    invalid_reward (required; train_grpo.py binds its INVALID_REWARD with bind_reward): a number scores such
    completions, so the group pushes them down against valid answers (0.0, what the original recipe's TRL 0.23 did
    in effect); NaN leaves them out as TRL 1.x does ("unscorable": advantage 0, no gradient). TRL 1.16 passes
    `completions` decoded with skip_special_tokens=True (the channel markers are gone), so when `completion_ids` is
    given the text is decoded again with the markers kept. Row i's rewards come from the i-th entries of the
    reward_action_<k> lists, which TRL takes from the same dataset row as prompt i. Logs through TRL's log_metric
    (which TRL prefixes eval_ in evaluation) test_lora_adapter.py's quantities: action/valid_fraction,
    action/truncated_fraction, action/optimal_fraction, action/mean_reward (an invalid answer counts 0, whatever
    invalid_reward is) and, for rows with Q-values (the evaluation's), action/mean_regret_q over the valid answers
    (NaN, which TRL logs as None, when none is valid). Writes the rows to completion_log when one is bound, except
    evaluation rows (marked in the column run/evaluation.SPLIT_COLUMN).
    """
    reward_lists = (reward_action_0, reward_action_1, reward_action_2, reward_action_3)
    ids_list = completion_ids if completion_ids is not None else [None] * len(completions)
    texts, actions, rewards, truncated = [], [], [], []
    for i, (completion, ids) in enumerate(zip(completions, ids_list, strict=True)):
        text = completion_text(completion, ids)
        action, reward = score_completion(text, ids, [float(column[i]) for column in reward_lists], invalid_reward)
        texts.append(text)
        actions.append(action)
        rewards.append(reward)
        truncated.append(is_truncated(ids))
    if log_metric is not None and rewards:
        log_metric("action/valid_fraction", sum(a is not None for a in actions) / len(actions))
        log_metric("action/truncated_fraction", sum(truncated) / len(truncated))
        if optimal_action is not None:
            hits = sum(a is not None and a == int(t) for a, t in zip(actions, optimal_action, strict=True))
            log_metric("action/optimal_fraction", hits / len(actions))
        chosen = [float(reward_lists[a][i]) for i, a in enumerate(actions) if a is not None]
        log_metric("action/mean_reward", sum(chosen) / len(actions))
        q_lists = [kwargs.get(column) for column in Q_COLUMNS]
        if all(q is not None for q in q_lists):
            regrets = [max(float(q[i]) for q in q_lists) - float(q_lists[a][i]) for i, a in enumerate(actions)
                       if a is not None]
            log_metric("action/mean_regret_q", sum(regrets) / len(regrets) if regrets else math.nan)
    evaluation = (kwargs.get(SPLIT_COLUMN) or [None])[0] == EVAL_SPLIT
    if completion_log is not None and not evaluation:
        completion_log.write(log_rows(prompts, texts, actions, rewards, truncated, optimal_action, reward_lists,
                                      trainer_state, completion_log.rows_per_slot))
    return rewards


def bind_reward(invalid_reward: float, completion_log: CompletionLog | None):
    """reward_fn with invalid_reward and the completion log bound, keeping reward_fn's name (TRL names the reward
    metrics after it: rewards/reward_fn/mean)."""
    bound = functools.partial(reward_fn, invalid_reward=invalid_reward, completion_log=completion_log)
    return functools.update_wrapper(bound, reward_fn)


# ---------------------------------------------------------------------------------------------------------------
# Completion log
# ---------------------------------------------------------------------------------------------------------------

_calls_without_state = itertools.count(1)


@dataclasses.dataclass(frozen=True)
class CompletionLog:
    """Where the bound reward function appends every completion (CSV), and how many completions make one
    micro-step's slot of prompts (PROMPTS_PER_STEP x NUM_GENERATIONS, to label each row's micro_step)."""

    path: Path
    rows_per_slot: int = 0  # 0 = the whole batch is one slot

    def write(self, rows: list[list]) -> None:
        """Appends this batch's rows, every process's, to the CSV (header first when the file is new). Called on
        every process (TRL scores each process's completions there); rank 0 gathers the rows and writes."""
        rows = gather_on_main(rows)
        if rows is None:
            return
        self.path.parent.mkdir(parents=True, exist_ok=True)
        new_file = not self.path.exists() or self.path.stat().st_size == 0
        # backslashreplace: a sampled completion can decode to a lone surrogate, which UTF-8 cannot encode
        with open(self.path, "a", encoding="utf-8", errors="backslashreplace", newline="") as handle:
            # every field quoted: csv.writer leaves a bare \r unquoted under lineterminator="\n", and every reader
            # (pandas, csv) then splits the row there; completions can hold one
            writer = csv.writer(handle, lineterminator="\n", quoting=csv.QUOTE_ALL)
            if new_file:
                writer.writerow(LOG_COLUMNS)
            writer.writerows(rows)


def target_actions(optimal_action, reward_lists, count: int) -> list[int]:
    """The row's optimal action (column optimal_action), or the argmax of its rewards when the column is absent."""
    if optimal_action is not None:
        return [int(a) for a in optimal_action]
    return [max(range(NUM_ACTIONS), key=lambda k: float(reward_lists[k][i])) for i in range(count)]


def log_rows(prompts, texts, actions, rewards, truncated, optimal_action, reward_lists, trainer_state,
             rows_per_slot: int = 0) -> list[list]:
    """Completion-log rows for one reward call (one generation batch).

    step: the optimizer step these completions train (1-based, as in metrics.jsonl and TensorBoard); taken from
    TRL's trainer_state, else a count of calls. With train_grpo's GENERATION_STEPS=k a generation batch feeds k
    steps and TRL shuffles its completions across them, so which of them trains a row is not known here: step is
    the batch's first (the step whose policy sampled it; resume drops the rows of batches after its checkpoint).
    micro_step: the gradient-accumulation slot (0-based) of the row's prompt in this generation batch (k x
    GRADIENT_ACCUMULATION_STEPS slots with GENERATION_STEPS=k), rows_per_slot completions each, in generation order
    (the forward/backward passes TRAIN_BATCH_SIZE makes, and TRL's shuffling of completions across them, do not
    change it).
    """
    count = len(texts)
    step = trainer_state.global_step + 1 if trainer_state is not None else next(_calls_without_state)
    rows_per_slot = rows_per_slot or max(1, count)
    targets = target_actions(optimal_action, reward_lists, count)
    prompt_texts = prompts if prompts is not None else [""] * count
    rank = process_rank()
    return [
        [step, i // rows_per_slot, prompt_texts[i], texts[i], "" if actions[i] is None else actions[i],
         "" if math.isnan(rewards[i]) else rewards[i], int(truncated[i]), targets[i], rank]
        for i in range(count)
    ]


# ---------------------------------------------------------------------------------------------------------------
# Re-scoring a completion log (python data_reward.py completions.csv)
# ---------------------------------------------------------------------------------------------------------------

PATH = "runs/grpo-tiny/completions.csv"  # completion log to re-score (train_grpo.py writes OUT_DIR/completions.csv)


def rescore_log(path: Path) -> dict:
    """Re-parses every logged completion with parse_action; returns counts of valid, truncated and optimal answers
    and how many parsed actions differ from the logged ones."""
    header, rows = _read_log(path)
    column = {name: header.index(name) for name in ("completion", "action", "target_action")}
    valid = optimal = changed = 0
    for row in rows:
        action = parse_action(row[column["completion"]])
        valid += action is not None
        optimal += action is not None and str(action) == row[column["target_action"]]
        changed += ("" if action is None else str(action)) != row[column["action"]]
    truncated = sum(row[header.index("truncated")] == "1" for row in rows) if "truncated" in header else None
    return {"completions": len(rows), "valid": valid, "optimal": optimal, "truncated": truncated,
            "actions_differing_from_log": changed}


def _read_log(path: Path) -> tuple[list[str], list[list[str]]]:
    from tes_grpo.run.run_folder import read_completion_log

    header, rows, _ = read_completion_log(path)
    missing = [name for name in ("completion", "action", "target_action") if name not in header]
    if missing:
        raise InputError(path, f"not a completion log: missing column(s) {', '.join(missing)}")
    return header, rows


def main(argv: list[str] | None = None) -> int:
    from tes_grpo.run.script_config import resolve

    # only PATH is a setting here; the module's other constants describe the data format
    settings = resolve({"PATH": PATH, "__doc__": __doc__, "__file__": __file__}, argv, positional="PATH")
    path = Path(settings.PATH)
    try:
        if not path.is_file():
            raise InputError(path, "no such completion log (train_grpo.py writes OUT_DIR/completions.csv)")
        summary = rescore_log(path)
    except (InputError, OSError) as err:
        print(f"error: {err}", file=sys.stderr)
        return 1
    n = max(1, summary["completions"])
    print(f"{path}: {summary['completions']} completions, valid {summary['valid'] / n:.1%}, optimal "
          f"{summary['optimal'] / n:.1%}"
          + (f", truncated {summary['truncated'] / n:.1%}" if summary["truncated"] is not None else "")
          + f"; {summary['actions_differing_from_log']} parsed actions differ from the logged ones")
    gap = sampler_gap_line(path.parent / "metrics.jsonl")
    if gap:
        print(gap)
    return 0


def sampler_gap_line(metrics_path: Path) -> str | None:
    """The run's sampler-trainer gap (sampling_fidelity.gap_summary) from the metrics.jsonl beside the log, if any."""
    from tes_grpo.run.run_folder import read_metrics
    from tes_grpo.sampling.sampling_fidelity import gap_summary

    return gap_summary(read_metrics(metrics_path, say=lambda line: None)) if metrics_path.is_file() else None


__all__ = [
    "HARMONY_GLOB", "LOG_COLUMNS", "NUM_ACTIONS", "RECORD_COLUMNS", "REWARD_COLUMNS", "CompletionLog",
    "apply_reasoning_effort", "bind_reward", "check_frame", "check_prompt_lengths", "load_training_frames",
    "reward_fn",
]


if __name__ == "__main__":
    sys.exit(main())
