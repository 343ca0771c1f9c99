"""Training data and reward for GRPO on the TES task: load and check the Harmony CSVs, score completions.

Not a script: `train_grpo.py` imports it. The pieces:

- `load_training_frames(data_dir, eval_dir)`: every `*_harmony.csv` under `data_dir` except those under
  `eval_dir`, columns checked (errors name file, row, column and value).
- `check_prompt_lengths(...)`: prompts longer than the token limit fail (naming file and row) or are skipped
  with a printed count; never cut, which would drop the Harmony header.
- `set_reasoning_effort(prompt, effort)`: rewrites the `Reasoning:` line of a rendered Harmony prompt.
- `parse_action(text)`: the action in a completion's final channel, or None.
- `reward_fn(completions, reward_action_0, ..., reward_action_3, **kwargs)`: TRL reward function; the row's
  `reward_action_<k>` for the parsed action k, NaN when the completion has no valid final answer.

Completion log (written by `reward_fn` while training; environment variables so TRL need not know of it):
`GRPO_LOG_COMPLETIONS` (default 1) turns it on, `GRPO_COMPLETION_LOG_PATH` names the CSV (train_grpo.py sets it
to `OUT/completions.csv` unless you set it), `GRPO_STEPS_PER_GENERATION` (set by train_grpo.py) says how many
micro-steps one generation batch feeds. Columns: step, micro_step, prompt, completion, action, reward,
target_action, rank (the process that generated the row; 0 on one GPU). On several processes every rank's rows
are gathered to rank 0, which alone writes; rows are appended (a resumed run continues the file) and the file is
closed after every batch.
"""

from __future__ import annotations

import csv
import functools
import itertools
import math
import os
import re
from pathlib import Path

import pandas as pd

from tes_grpo.fileio import InputError
from tes_grpo.processes import gather_on_main, process_rank, say

NUM_ACTIONS = 4
REWARD_COLUMNS = [f"reward_action_{k}" for k in range(NUM_ACTIONS)]
REQUIRED_COLUMNS = ["prompt", "optimal_action", *REWARD_COLUMNS]
# What StepStream hands to TRL per row; TRL passes every column but `prompt` to reward_fn as a keyword list.
RECORD_COLUMNS = ["prompt", "optimal_action", *REWARD_COLUMNS]
HARMONY_GLOB = "*_harmony.csv"
LOG_COLUMNS = ["step", "micro_step", "prompt", "completion", "action", "reward", "target_action", "rank"]

# Harmony special tokens (o200k_harmony ids) that matter for reading a completion.
END_MARKERS = ("<|return|>", "<|end|>", "<|call|>")  # close a message
STOP_TOKEN_IDS = frozenset({200002, 200012, 199999})  # <|return|>, <|call|>, <|endoftext|>: generation stopped
FINAL_HEADER = re.compile(r"<\|channel\|>final(?:[ \t][^<]*)?<\|message\|>")
# ASCII digits only: the prompt asks for `[k]`, and `\d` would also accept e.g. fullwidth digits.
BRACKETED_INT = re.compile(r"\[(-?[0-9]+)\]")
REASONING_LINE = re.compile(r"(<\|start\|>system<\|message\|>(?:(?!<\|end\|>).)*?\nReasoning: )([A-Za-z]+)(\n)",
                            re.DOTALL)
REASONING_EFFORTS = ("low", "medium", "high")


# ---------------------------------------------------------------------------------------------------------------
# Loading and checking the training CSVs
# ---------------------------------------------------------------------------------------------------------------

def training_csv_paths(data_dir: str | os.PathLike, eval_dir: str | os.PathLike | None) -> list[Path]:
    """Sorted `*_harmony.csv` files under data_dir, leaving out everything under eval_dir."""
    data_dir = Path(data_dir)
    eval_root = Path(eval_dir).resolve() if eval_dir else None
    paths = []
    for path in sorted(data_dir.rglob(HARMONY_GLOB)):
        if eval_root is not None and path.resolve().is_relative_to(eval_root):
            continue
        paths.append(path)
    return paths


def check_frame(frame: pd.DataFrame, path: str | os.PathLike) -> pd.DataFrame:
    """Checks one training CSV's columns and values; returns the checked columns with parsed dtypes.

    Rows are numbered from 1 for the first data row (the header is not counted); prompts hold newlines, so
    CSV records and file lines differ.
    """
    missing = [column for column in REQUIRED_COLUMNS if column not in frame.columns]
    if missing:
        raise InputError(path, f"missing column(s) {', '.join(missing)}; found {', '.join(map(str, frame.columns))}")
    if len(frame) == 0:
        raise InputError(path, "no data rows")
    checked = {}
    prompts = []
    for row, value in enumerate(frame["prompt"], start=1):
        if not isinstance(value, str) or not value.strip():
            raise InputError(path, "empty prompt", row=row, column="prompt", value=value)
        if not value.startswith("<|start|>") or not value.rstrip().endswith("<|start|>assistant"):
            raise InputError(path, "not a Harmony prompt with the generation prompt appended (should start with "
                             "'<|start|>' and end with '<|start|>assistant'); run the data pipeline's Harmony "
                             "rendering first", row=row, column="prompt", value=value[:80])
        prompts.append(value)
    checked["prompt"] = prompts
    actions = []
    for row, value in enumerate(frame["optimal_action"], start=1):
        number = pd.to_numeric(value, errors="coerce")
        if pd.isna(number) or number != int(number) or not 0 <= int(number) < NUM_ACTIONS:
            raise InputError(path, f"optimal_action must be an integer 0..{NUM_ACTIONS - 1}", row=row,
                             column="optimal_action", value=value)
        actions.append(int(number))
    checked["optimal_action"] = actions
    for column in REWARD_COLUMNS:
        values = []
        for row, value in enumerate(frame[column], start=1):
            number = pd.to_numeric(value, errors="coerce")
            if pd.isna(number) or not math.isfinite(float(number)):
                raise InputError(path, "reward must be a finite number (run calculate_reward.py first)", row=row,
                                 column=column, value=value)
            values.append(float(number))
        checked[column] = values
    result = pd.DataFrame(checked)
    result["source"] = [f"{Path(path).name}:{row}" for row in range(1, len(result) + 1)]
    return result


def load_training_frames(data_dir: str | os.PathLike, eval_dir: str | os.PathLike | None) -> pd.DataFrame:
    """All training rows (every `*_harmony.csv` under data_dir, eval_dir left out), checked, in one frame.

    Columns: prompt, optimal_action, reward_action_0..3 and `source` ("<file>:<row>", for messages).
    Raises InputError naming the file, row, column and value of the first bad cell.
    """
    paths = training_csv_paths(data_dir, eval_dir)
    if not paths:
        raise InputError(data_dir, f"no training files matching {HARMONY_GLOB} (outside {eval_dir}); "
                         "build the datasets with the data pipeline first")
    frames = []
    for path in paths:
        try:
            raw = pd.read_csv(path, dtype={"prompt": str}, keep_default_na=False, na_values=[""])
        except (pd.errors.ParserError, pd.errors.EmptyDataError, UnicodeDecodeError) as err:
            raise InputError(path, f"not a readable CSV ({err})") from None
        frames.append(check_frame(raw, path))
    return pd.concat(frames, ignore_index=True)


def set_reasoning_effort(prompt: str, effort: str) -> str:
    """The prompt with its system message's `Reasoning: <effort>` line set to `effort` ("" keeps it).

    Raises ValueError when effort is not low/medium/high or the prompt has no Reasoning line to rewrite.
    """
    if effort == "":
        return prompt
    if effort not in REASONING_EFFORTS:
        raise ValueError(f"reasoning effort must be one of {', '.join(REASONING_EFFORTS)} or '' (keep), "
                         f"got {effort!r}")
    rewritten, count = REASONING_LINE.subn(lambda m: m.group(1) + effort + m.group(3), prompt, count=1)
    if count != 1:
        raise ValueError("no 'Reasoning: ...' line in the prompt's system message")
    return rewritten


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
    kept = frame.drop(index=frame.index[too_long]).reset_index(drop=True)
    if len(kept) == 0:
        raise InputError("training data", f"every prompt is longer than MAX_PROMPT_LEN={max_prompt_len} tokens")
    say(f"prompt lengths: {min(lengths)}..{max(lengths)} tokens, {len(kept)} prompts kept")
    return kept


# ---------------------------------------------------------------------------------------------------------------
# Reading completions and scoring them
# ---------------------------------------------------------------------------------------------------------------

def parse_action(completion_text: str) -> int | None:
    """The action k in 0..3 from the last final-channel message of a Harmony completion, else None.

    The text must keep its special tokens (`<|channel|>final<|message|>...<|return|>`). The answer is the last
    bracketed integer `[k]` in that message; None when there is no final channel, the final message is not closed
    by <|return|>/<|end|>/<|call|> (truncated), it holds no bracketed integer, or the integer is outside 0..3.
    """
    headers = list(FINAL_HEADER.finditer(completion_text))
    if not headers:
        return None
    content = completion_text[headers[-1].end():]
    ends = [content.find(marker) for marker in END_MARKERS if marker in content]
    if not ends:
        return None
    answers = BRACKETED_INT.findall(content[:min(ends)])
    if not answers:
        return None
    return _small_action(answers[-1])


def _small_action(text: str) -> int | None:
    """The action 0..3 that a bracketed integer's text names, else None; never raises.

    int() refuses texts of more than 4,300 digits (Python's int-conversion limit) and a generated answer may be
    any length, so the digits are counted before converting: more than one significant digit is never 0..3.
    """
    digits = text.lstrip("-").lstrip("0") or "0"
    if len(digits) > 1:
        return None
    action = int(text[0] + digits) if text.startswith("-") else int(digits)
    return action if 0 <= action < NUM_ACTIONS else None


@functools.lru_cache(maxsize=1)
def _decoding_tokenizer():
    from tes_grpo.gpt_oss_tokenizer import load_tokenizer

    return load_tokenizer()


def decode_with_special_tokens(ids: list[int]) -> str:
    """Completion ids as text with the Harmony markers kept (TRL's own decode drops them)."""
    return _decoding_tokenizer().decode(list(ids), skip_special_tokens=False)


def completion_text(completion, ids: list[int] | None) -> str:
    """The completion as Harmony text: decoded from its ids when TRL passed them, else the given text."""
    if ids is not None:
        return decode_with_special_tokens(ids)
    if isinstance(completion, list):  # conversational form: [{"role": "assistant", "content": ...}]
        return "".join(message.get("content") or "" for message in completion)
    return completion


def score_completion(text: str, ids: list[int] | None, rewards: list[float]) -> tuple[int | None, float]:
    """(action, reward) for one completion; reward is NaN when the action is invalid or generation was cut."""
    if ids is not None and (len(ids) == 0 or ids[-1] not in STOP_TOKEN_IDS):
        return None, math.nan  # cut at MAX_COMPLETION_LEN: the model never finished its answer
    action = parse_action(text)
    if action is None:
        return None, math.nan
    return action, float(rewards[action])


def reward_fn(completions, reward_action_0, reward_action_1, reward_action_2, reward_action_3,
              completion_ids=None, prompts=None, optimal_action=None, trainer_state=None, log_metric=None,
              **kwargs) -> list[float]:
    """TRL reward function: the completion's row reward for its parsed action, NaN when invalid or truncated.

    TRL 1.16 passes `completions` decoded with skip_special_tokens=True (the channel markers are gone), so when
    `completion_ids` is given the text is decoded again with the markers kept. Row i's rewards come from the
    i-th entries of the reward_action_<k> lists, which TRL takes from the same dataset row as prompt i.
    """
    reward_lists = (reward_action_0, reward_action_1, reward_action_2, reward_action_3)
    ids_list = completion_ids if completion_ids is not None else [None] * len(completions)
    texts, actions, rewards = [], [], []
    for i, (completion, ids) in enumerate(zip(completions, ids_list, strict=True)):
        text = completion_text(completion, ids)
        action, reward = score_completion(text, ids, [float(column[i]) for column in reward_lists])
        texts.append(text)
        actions.append(action)
        rewards.append(reward)
    if log_metric is not None and rewards:
        log_metric("action/valid_fraction", sum(a is not None for a in actions) / len(actions))
        if optimal_action is not None:
            hits = sum(a is not None and a == int(t) for a, t in zip(actions, optimal_action, strict=True))
            log_metric("action/optimal_fraction", hits / len(actions))
    if completion_log_enabled():
        write_completion_log(prompts, texts, actions, rewards, optimal_action, reward_lists, trainer_state)
    return rewards


# ---------------------------------------------------------------------------------------------------------------
# Completion log
# ---------------------------------------------------------------------------------------------------------------

_calls_without_state = itertools.count(1)


def completion_log_path() -> Path | None:
    path = os.environ.get("GRPO_COMPLETION_LOG_PATH", "")
    return Path(path) if path else None


def completion_log_enabled() -> bool:
    """On when GRPO_LOG_COMPLETIONS is not 0/false/no/off and GRPO_COMPLETION_LOG_PATH names a file."""
    flag = os.environ.get("GRPO_LOG_COMPLETIONS", "1").strip().lower()
    return flag not in ("0", "false", "no", "off") and completion_log_path() is not None


def target_actions(optimal_action, reward_lists, count: int) -> list[int]:
    """The row's optimal action (column optimal_action), or the argmax of its rewards when the column is absent."""
    if optimal_action is not None:
        return [int(a) for a in optimal_action]
    return [max(range(NUM_ACTIONS), key=lambda k: float(reward_lists[k][i])) for i in range(count)]


def log_rows(prompts, texts, actions, rewards, optimal_action, reward_lists, trainer_state) -> list[list]:
    """Completion-log rows for one reward call (one generation batch).

    step: the optimizer step these completions train (1-based, as in metrics.jsonl and TensorBoard); taken from
    TRL's trainer_state, else a count of calls. micro_step: the slot (0-based) of the row's prompt among the
    GRPO_STEPS_PER_GENERATION micro-steps that this generation batch feeds (TRL shuffles completions across
    those micro-steps after scoring, so it labels the generation order, not the backward pass).
    """
    count = len(texts)
    step = trainer_state.global_step + 1 if trainer_state is not None else next(_calls_without_state)
    slots = max(1, int(os.environ.get("GRPO_STEPS_PER_GENERATION", "1")))
    rows_per_slot = max(1, count // slots)
    targets = target_actions(optimal_action, reward_lists, count)
    prompt_texts = prompts if prompts is not None else [""] * count
    rank = process_rank()
    return [
        [step, i // rows_per_slot, prompt_texts[i], texts[i], "" if actions[i] is None else actions[i],
         "" if math.isnan(rewards[i]) else rewards[i], targets[i], rank]
        for i in range(count)
    ]


def write_completion_log(prompts, texts, actions, rewards, optimal_action, reward_lists, trainer_state) -> None:
    """Appends this batch's rows, every process's, to the completion log (header first when the file is new).

    Called on every process (TRL scores each process's completions there); rank 0 gathers the rows and writes.
    """
    rows = gather_on_main(log_rows(prompts, texts, actions, rewards, optimal_action, reward_lists, trainer_state))
    if rows is None:
        return
    path = completion_log_path()
    path.parent.mkdir(parents=True, exist_ok=True)
    new_file = not path.exists() or path.stat().st_size == 0
    with open(path, "a", encoding="utf-8", newline="") as handle:
        writer = csv.writer(handle, lineterminator="\n")
        if new_file:
            writer.writerow(LOG_COLUMNS)
        writer.writerows(rows)


__all__ = [
    "LOG_COLUMNS", "NUM_ACTIONS", "RECORD_COLUMNS", "REQUIRED_COLUMNS", "REWARD_COLUMNS", "STOP_TOKEN_IDS",
    "apply_reasoning_effort", "check_frame", "check_prompt_lengths", "completion_log_enabled", "load_training_frames",
    "parse_action", "reward_fn", "set_reasoning_effort", "training_csv_paths",
]
