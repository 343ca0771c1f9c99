"""gpt-oss's Harmony format, one home for every fact about it: where the tokenizer comes from, prompts rendered with
its chat template, the reasoning effort, the special tokens that end a message or a generation, the
`*_harmony.csv` naming of rendered datasets, and reading the action out of a completion's final message.

Tokenizer: `GPT_OSS_TOKENIZER` (environment) names a local folder or hub id. Unset, the project uses
`../shared/gpt-oss-tokenizer` beside the repo when it exists, else the hub id `openai/gpt-oss-20b` (from the Hub, or
the local Hugging Face cache), and says so. `check_tokenizer_source` checks that choice in about a second, without
transformers, so that the scripts stop at start-up with one line saying what to do (SourceError), never at the first
decode; `load_tokenizer` runs it too. Every tokenizer loaded here is checked once against the token ids below, so a
tokenizer that is not gpt-oss's fails at load with the ids it has, never later as a silent misreading of
completions.

Prompts are rendered by the tokenizer's own chat template (`render_harmony_prompt`), with the "Current date:" line
pinned so outputs are reproducible; OpenAI's `openai-harmony` renders the same conversation (tests/test_harmony.py
compares the two) and `harmony_encoding()` loads it offline.
"""

from __future__ import annotations

import functools
import os
import re
import sys
from datetime import date as _date
from pathlib import Path

from tes_grpo.run.sources import SourceError, check_source, hub_problem
from tes_grpo.task.tes_env import N_ACTIONS

HUB_ID = "openai/gpt-oss-20b"
REPO_ROOT = Path(__file__).resolve().parents[2]
SHARED_TOKENIZER = REPO_ROOT.parent / "shared" / "gpt-oss-tokenizer"

# o200k_harmony's special tokens that this project reads or writes, with their ids (checked at every tokenizer load).
START, END, RETURN, CALL = "<|start|>", "<|end|>", "<|return|>", "<|call|>"
ENDOFTEXT, STARTOFTEXT = "<|endoftext|>", "<|startoftext|>"
TOKEN_IDS = {RETURN: 200002, CALL: 200012, ENDOFTEXT: 199999, STARTOFTEXT: 199998, START: 200006, END: 200007}
RETURN_ID, CALL_ID, PAD_ID, BOS_ID = TOKEN_IDS[RETURN], TOKEN_IDS[CALL], TOKEN_IDS[ENDOFTEXT], TOKEN_IDS[STARTOFTEXT]
STOP_TOKEN_IDS = frozenset({RETURN_ID, CALL_ID, PAD_ID})  # generation has stopped (gpt-oss's generation_config)
ANSWER_END_IDS = (RETURN_ID, CALL_ID)  # what a served model stops on: a final answer or a tool call
END_MARKERS = (RETURN, END, CALL)  # close a message
GENERATION_PROMPT = f"{START}assistant"  # ends every rendered prompt: the model writes the assistant's turn next

REASONING_EFFORTS = ("low", "medium", "high")
DATASET_REASONING_EFFORT = "medium"  # the effort data/ was rendered with
DATASET_DATE = "2025-08-05"  # the "Current date:" data/ was rendered with

HARMONY_SUFFIX = "_harmony"  # X.csv rendered to Harmony is X_harmony.csv
HARMONY_GLOB = f"*{HARMONY_SUFFIX}.csv"

FINAL_HEADER = re.compile(r"<\|channel\|>final(?:[ \t][^<]*)?<\|message\|>")
# ASCII digits only: the prompt asks for `[k]`, and `\d` would also accept e.g. fullwidth digits.
BRACKETED_INT = re.compile(r"\[(-?[0-9]+)\]")
REASONING_LINE = re.compile(r"(<\|start\|>system<\|message\|>(?:(?!<\|end\|>).)*?\nReasoning: )([A-Za-z]+)(\n)",
                            re.DOTALL)
_TEMPLATE_DATE_CALL = 'strftime_now("%Y-%m-%d")'


# ---------------------------------------------------------------------------------------------------------------
# Tokenizer and OpenAI's encoding
# ---------------------------------------------------------------------------------------------------------------

def tokenizer_source() -> str:
    """Local folder or hub id of the gpt-oss tokenizer (see module docstring), unchecked."""
    env = os.environ.get("GPT_OSS_TOKENIZER")
    if env:
        return env
    if SHARED_TOKENIZER.is_dir():
        return str(SHARED_TOKENIZER)
    return HUB_ID


# what to do when there is no tokenizer: the one remedy every message about it ends with
GET_A_TOKENIZER = (f"set GPT_OSS_TOKENIZER to a folder with gpt-oss's tokenizer.json (AutoTokenizer.from_pretrained("
                   f"'{HUB_ID}').save_pretrained(FOLDER) writes one where the Hub can be reached)")
_said: set[str] = set()


def _say_once(say, line: str) -> None:
    if line not in _said:
        _said.add(line)
        say(line)


def check_tokenizer_source(source: str | None = None, say=print) -> str:
    """The tokenizer's folder or hub id (default: tokenizer_source()) once it is known to be there: a folder with a
    tokenizer.json, or a hub id in the local cache or on a Hub that answers (sources.check_source). SourceError
    otherwise, one line naming GPT_OSS_TOKENIZER (or the source given) and what to do. Imports no transformers."""
    if source is not None:
        return check_source(source, "tokenizer", "tokenizer.json", GET_A_TOKENIZER, known=(HUB_ID,), say=say)
    env = os.environ.get("GPT_OSS_TOKENIZER")
    if env:
        return check_source(env, "GPT_OSS_TOKENIZER", "tokenizer.json",
                            f"{GET_A_TOKENIZER}, or unset it to use {SHARED_TOKENIZER} or else the Hub's {HUB_ID}",
                            known=(HUB_ID,), say=say)
    if SHARED_TOKENIZER.is_dir():
        return check_source(str(SHARED_TOKENIZER), "the shared tokenizer folder", "tokenizer.json", GET_A_TOKENIZER,
                            say=say)
    problem = hub_problem(HUB_ID, "tokenizer.json", say)
    if problem:
        raise SourceError(f"no gpt-oss tokenizer: GPT_OSS_TOKENIZER is unset, there is no folder {SHARED_TOKENIZER}, "
                          f"and the Hub's {HUB_ID} {problem}; {GET_A_TOKENIZER}")
    _say_once(say, f"note: tokenizer: the Hub's {HUB_ID} (GPT_OSS_TOKENIZER is unset and there is no folder "
                   f"{SHARED_TOKENIZER})")
    return HUB_ID


def check_token_ids(tokenizer, source: str = "the tokenizer") -> None:
    """ValueError unless the tokenizer maps every special token of TOKEN_IDS to its gpt-oss id."""
    wrong = {token: tokenizer.convert_tokens_to_ids(token) for token in TOKEN_IDS}
    wrong = {token: got for token, got in wrong.items() if got != TOKEN_IDS[token]}
    if wrong:
        raise ValueError(f"{source} is not gpt-oss's tokenizer: it maps "
                         + ", ".join(f"{token} to {got} (expected {TOKEN_IDS[token]})" for token, got in wrong.items()))


@functools.lru_cache(maxsize=4)
def load_tokenizer(source: str | None = None):
    """The tokenizer from `source` (default tokenizer_source()), checked first (check_tokenizer_source: SourceError,
    one line, before transformers is asked), its special token ids checked after."""
    source = check_tokenizer_source(source or None, say=lambda line: print(line, file=sys.stderr))
    from transformers import AutoTokenizer  # here: scripts import harmony at the top, --help needs no transformers

    try:
        tokenizer = AutoTokenizer.from_pretrained(source)
    except OSError as err:  # a folder with a broken tokenizer.json, a download cut short
        said = " ".join(str(err).split()) or type(err).__name__
        raise SourceError(f"tokenizer {source}: cannot load it ({said[:300]}); {GET_A_TOKENIZER}") from None
    check_token_ids(tokenizer, source)
    return tokenizer


@functools.lru_cache(maxsize=1)
def harmony_encoding():
    """OpenAI's Harmony encoding for gpt-oss; reads o200k_base from the local tokenizer folder if any."""
    source = Path(tokenizer_source())
    if (source / "o200k_base.tiktoken").is_file() and "TIKTOKEN_ENCODINGS_BASE" not in os.environ:
        # tiktoken reads this variable only; setting it keeps openai-harmony off the network
        os.environ["TIKTOKEN_ENCODINGS_BASE"] = str(source.resolve())
    from openai_harmony import HarmonyEncodingName, load_harmony_encoding  # after TIKTOKEN_ENCODINGS_BASE is set

    return load_harmony_encoding(HarmonyEncodingName.HARMONY_GPT_OSS)


# ---------------------------------------------------------------------------------------------------------------
# Prompts
# ---------------------------------------------------------------------------------------------------------------

def prompt_problem(text) -> str | None:
    """Why `text` is not a rendered Harmony prompt ready for generation (None: it is one)."""
    if not isinstance(text, str) or not text.strip():
        return "empty prompt"
    # exactly the generation prompt at the end: a trailing newline would be one more token the model never saw there
    if text.startswith(START) and not text.endswith(GENERATION_PROMPT) and text.rstrip().endswith(GENERATION_PROMPT):
        return f"whitespace after the generation prompt '{GENERATION_PROMPT}' at the end: remove it"
    if not text.startswith(START) or not text.endswith(GENERATION_PROMPT):
        return (f"not a Harmony prompt with the generation prompt appended (should start with '{START}' and end "
                f"with '{GENERATION_PROMPT}'); render it with convert_to_harmony.py first")
    return None


def is_harmony(text: str) -> bool:
    """Whether text already starts like a Harmony rendering (leading whitespace ignored)."""
    return text.lstrip().startswith(START)


def check_reasoning_effort(effort: str, name: str = "REASONING_EFFORT") -> str:
    """`effort` if it is one of REASONING_EFFORTS, else ValueError naming the setting."""
    if effort not in REASONING_EFFORTS:
        raise ValueError(f"--{name}={effort!r}: reasoning effort must be one of {', '.join(REASONING_EFFORTS)}")
    return effort


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


def check_date(text: str, name: str = "DATE") -> str:
    """`text` if it is a real date written YYYY-MM-DD, else ValueError naming the setting."""
    try:
        if not re.fullmatch(r"\d{4}-\d{2}-\d{2}", text):
            raise ValueError("expected YYYY-MM-DD")
        _date.fromisoformat(text)
    except ValueError as err:
        raise ValueError(f"--{name}={text!r}: not a real date YYYY-MM-DD ({err})") from None
    return text


def pinned_date_template(template: str, date: str) -> str:
    """The chat template with its one strftime_now("%Y-%m-%d") call replaced by the literal `date`.

    transformers hands templates only plain data, so a strftime_now callable cannot be passed as a template kwarg.
    """
    check_date(date)
    count = template.count(_TEMPLATE_DATE_CALL)
    if count != 1:
        raise ValueError(f"the chat template calls {_TEMPLATE_DATE_CALL} {count} times, expected exactly once; "
                         "cannot pin the date")
    return template.replace(_TEMPLATE_DATE_CALL, f'"{date}"')


def render_harmony_prompt(system: str, user: str, tokenizer=None, reasoning_effort: str = DATASET_REASONING_EFFORT,
                          date: str = DATASET_DATE) -> str:
    """Harmony text of a developer (`system`) + user conversation, ending with `<|start|>assistant`.

    The `system` part becomes gpt-oss's developer "# Instructions"; tokenizer None loads the default one.
    """
    check_reasoning_effort(reasoning_effort)
    tokenizer = tokenizer if tokenizer is not None else load_tokenizer()
    template = pinned_date_template(tokenizer.chat_template, date)
    messages = [{"role": "system", "content": system}, {"role": "user", "content": user}]
    text = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True,
                                         reasoning_effort=reasoning_effort, chat_template=template)
    date_line = f"Current date: {date}\n"
    if text.count(date_line) != 1:
        raise ValueError(f"the rendered prompt has {text.count(date_line)} '{date_line.strip()}' lines, expected 1")
    return text


# ---------------------------------------------------------------------------------------------------------------
# Rendered datasets on disk
# ---------------------------------------------------------------------------------------------------------------

def harmony_output_path(path: str | os.PathLike) -> Path:
    """Where X.csv's Harmony rendering goes: X_harmony.csv beside it."""
    path = Path(path)
    return path.with_name(f"{path.stem}{HARMONY_SUFFIX}{path.suffix}")


def harmony_csv_files(folder: str | os.PathLike, exclude: str | os.PathLike | None = None) -> list[Path]:
    """Sorted `*_harmony.csv` files under folder, leaving out everything under `exclude`."""
    excluded = Path(exclude).resolve() if exclude else None
    return [path for path in sorted(Path(folder).rglob(HARMONY_GLOB))
            if excluded is None or not path.resolve().is_relative_to(excluded)]


# ---------------------------------------------------------------------------------------------------------------
# Completions
# ---------------------------------------------------------------------------------------------------------------

def final_message(text: str) -> tuple[str, bool] | None:
    """(content, closed) of the last final-channel message of a Harmony completion, None when there is none.

    closed: whether <|return|>, <|end|> or <|call|> ends it (content stops there); an unclosed message was cut off
    and runs to the end of the text. The text must keep its special tokens.
    """
    headers = list(FINAL_HEADER.finditer(text))
    if not headers:
        return None
    content = text[headers[-1].end():]
    ends = [content.find(marker) for marker in END_MARKERS if marker in content]
    return (content[:min(ends)], True) if ends else (content, False)


def parse_action(completion_text: str) -> int | None:
    """The action k in 0..N_ACTIONS-1 from the last final-channel message of a Harmony completion, else None.

    The answer is the last bracketed integer `[k]` in that message; None when there is no final channel, the final
    message is not closed (truncated), it holds no bracketed integer, or the integer is out of range.
    """
    final = final_message(completion_text)
    if final is None or not final[1]:
        return None
    answers = BRACKETED_INT.findall(final[0])
    return _small_action(answers[-1]) if answers else None


def _small_action(text: str) -> int | None:
    """The action that a bracketed integer's text names, else None; never raises.

    int() refuses texts of more than 4,300 digits (Python's int-conversion limit) and a generated answer may be
    any length, so the digits are counted before converting: more than one significant digit is never an action.
    """
    digits = text.lstrip("-").lstrip("0") or "0"
    if len(digits) > 1:
        return None
    action = int(text[0] + digits) if text.startswith("-") else int(digits)
    return action if 0 <= action < N_ACTIONS else None


def is_truncated(ids: list[int] | None) -> bool:
    """Whether generation was cut at the length limit (no stop token at the end); unknown (False) without ids."""
    return ids is not None and (len(ids) == 0 or ids[-1] not in STOP_TOKEN_IDS)


__all__ = [
    "ANSWER_END_IDS", "BOS_ID", "CALL_ID", "DATASET_DATE", "DATASET_REASONING_EFFORT", "END_MARKERS", "FINAL_HEADER",
    "GENERATION_PROMPT", "HARMONY_GLOB", "HARMONY_SUFFIX", "PAD_ID", "REASONING_EFFORTS", "RETURN_ID",
    "STOP_TOKEN_IDS", "TOKEN_IDS", "SourceError", "check_date", "check_reasoning_effort", "check_token_ids",
    "check_tokenizer_source", "final_message",
    "harmony_csv_files", "harmony_encoding", "harmony_output_path", "is_harmony", "is_truncated", "load_tokenizer",
    "parse_action", "pinned_date_template", "prompt_problem", "render_harmony_prompt", "set_reasoning_effort",
    "tokenizer_source",
]
