"""Renders legacy two-part prompts (`system:` / `user:`) into gpt-oss Harmony text with the chat template.

    python convert_to_harmony.py data/train/X_q_dataset.csv [more.csv or folders ...] [--OVERWRITE]

For each X.csv it writes X_harmony.csv beside it: the `prompt` column rendered by the tokenizer's own chat
template (the `system` part becomes gpt-oss's developer "# Instructions", the `user` part the user message,
the generation prompt `<|start|>assistant` appended); every other column is kept as the same text.
A folder means every CSV below it with a `prompt` column, except *_harmony.csv files.
The template prints "Current date: <today>"; the date is pinned (DATE, a real YYYY-MM-DD date) by replacing the
template's strftime_now call with that literal, so outputs are reproducible. (transformers hands templates only
plain data, so a strftime_now callable cannot be passed as a template kwarg.)
Refuses an existing output without --OVERWRITE, a prompt that is already Harmony (starts with <|start|>), duplicate
column names and text that is not UTF-8. Every file is checked before anything is written, and the outputs are
written all or none.
Exit status: 0 done, 1 bad input file or failed write, 2 bad setting (including a tokenizer that cannot be loaded).
"""

from __future__ import annotations

import re
import sys
from datetime import date as _date
from pathlib import Path
from typing import Sequence

from tes_grpo.fileio import (
    InputError,
    csv_files,
    csv_writer,
    read_csv_header,
    read_csv_table,
    write_files_atomic,
)
from tes_grpo.tes_env import parse_legacy_prompt

PATHS: list = []  # legacy-prompt CSV files or folders (positional arguments)
TOKENIZER = ""  # tokenizer folder or hub id; "" = gpt_oss_tokenizer.tokenizer_source() (../shared/gpt-oss-tokenizer)
REASONING_EFFORT = "medium"  # the template's "Reasoning:" line: low, medium or high
DATE = "2025-08-05"  # the "Current date:" the template prints (YYYY-MM-DD), pinned for reproducible outputs
OVERWRITE = False  # replace existing *_harmony.csv outputs

_HARMONY_START = "<|start|>"
_HARMONY_SUFFIX = "_harmony"
_TEMPLATE_DATE_CALL = 'strftime_now("%Y-%m-%d")'
_REASONING_EFFORTS = ("low", "medium", "high")


def is_harmony(text: str) -> bool:
    return text.lstrip().startswith(_HARMONY_START)


def resolve_tokenizer_source(source: str = "") -> str:
    from tes_grpo.gpt_oss_tokenizer import tokenizer_source

    return source or tokenizer_source()


def _looks_like_a_path(source: str) -> bool:
    # a hub id is "name" or "owner/name"; anything else with a slash, or starting with . or ~, is a folder
    return source.startswith(("/", ".", "~")) or source.count("/") > 1 or "\\" in source


def check_tokenizer_source(source: str, name: str = "TOKENIZER") -> None:
    """ValueError naming the setting when `source` is meant as a folder that does not exist or is not a folder."""
    path = Path(source).expanduser()
    if path.exists():
        if not path.is_dir():
            raise ValueError(f"--{name}={source!r}: is a file; give the tokenizer's folder (or a hub id)")
    elif _looks_like_a_path(source):
        raise ValueError(f"--{name}={source!r}: the folder does not exist")


def get_tokenizer(source: str = ""):
    """The tokenizer from `source` ("" = the default); ValueError naming TOKENIZER if it cannot be loaded."""
    from tes_grpo.gpt_oss_tokenizer import load_tokenizer

    resolved = resolve_tokenizer_source(source)
    check_tokenizer_source(resolved)
    local = Path(resolved).expanduser()
    try:
        return load_tokenizer(str(local) if local.exists() else resolved)
    except (OSError, ValueError) as err:
        first_line = str(err).strip().splitlines()[0] if str(err).strip() else type(err).__name__
        raise ValueError(f"--TOKENIZER={resolved!r}: cannot load a tokenizer from it ({first_line})") from None


def check_date(text: str, name: str = "DATE") -> str:
    """`text` if it is a real date written YYYY-MM-DD, else ValueError naming the setting."""
    try:
        if not re.fullmatch(r"\d{4}-\d{2}-\d{2}", text):
            raise ValueError("expected YYYY-MM-DD")
        _date.fromisoformat(text)
    except ValueError as err:
        raise ValueError(f"--{name}={text!r}: not a real date YYYY-MM-DD ({err})") from None
    return text


def check_reasoning_effort(effort: str, name: str = "REASONING_EFFORT") -> str:
    if effort not in _REASONING_EFFORTS:
        raise ValueError(f"--{name}={effort!r}: reasoning effort must be one of {', '.join(_REASONING_EFFORTS)}")
    return effort


def pinned_date_template(template: str, date: str) -> str:
    """The chat template with its one strftime_now("%Y-%m-%d") call replaced by the literal `date`."""
    check_date(date)
    count = template.count(_TEMPLATE_DATE_CALL)
    if count != 1:
        raise ValueError(f"the chat template calls {_TEMPLATE_DATE_CALL} {count} times, expected exactly once; "
                         "cannot pin the date")
    return template.replace(_TEMPLATE_DATE_CALL, f'"{date}"')


def render_harmony_prompt(system: str, user: str, tokenizer=None, reasoning_effort: str = REASONING_EFFORT,
                          date: str = DATE) -> str:
    """Harmony text of a developer (`system`) + user conversation, ending with `<|start|>assistant`.

    tokenizer None loads the default one (gpt_oss_tokenizer.tokenizer_source()); a caller with its own
    settings passes its reasoning effort and date (the defaults are this script's defaults).
    """
    check_reasoning_effort(reasoning_effort)
    tokenizer = tokenizer if tokenizer is not None else get_tokenizer()
    template = pinned_date_template(tokenizer.chat_template, date)
    messages = [{"role": "system", "content": system}, {"role": "user", "content": user}]
    text = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True,
                                         reasoning_effort=reasoning_effort, chat_template=template)
    date_line = f"Current date: {date}\n"
    if text.count(date_line) != 1:
        raise ValueError(f"the rendered prompt has {text.count(date_line)} '{date_line.strip()}' lines, expected 1")
    return text


def harmony_output_path(path: str | Path) -> Path:
    path = Path(path)
    return path.with_name(f"{path.stem}{_HARMONY_SUFFIX}{path.suffix}")


def legacy_parts(frame, path) -> list[tuple[str, str]]:
    """(system, user) of every row; InputError naming the row if a prompt is missing, Harmony or malformed."""
    if "prompt" not in frame.columns:
        raise InputError(path, "no 'prompt' column")
    if len(frame) == 0:
        raise InputError(path, "no data rows")
    parts = []
    for index, text in enumerate(frame["prompt"]):
        row = index + 1
        if not text.strip():
            raise InputError(path, "empty prompt", row=row, column="prompt")
        if is_harmony(text):
            raise InputError(path, "prompt is already in Harmony format (starts with <|start|>)", row=row,
                             column="prompt")
        try:
            parts.append(parse_legacy_prompt(text))
        except ValueError as err:
            raise InputError(path, f"not a legacy two-part prompt: {err}", row=row, column="prompt") from None
    return parts


def has_prompt_column(path: Path) -> bool:
    return "prompt" in read_csv_header(path)


def expand_paths(paths: Sequence) -> list[Path]:
    """Files as given; folders expanded to their CSVs with a prompt column that are not *_harmony.csv outputs."""
    files, _ = csv_files(paths, wanted=lambda p: not p.stem.endswith(_HARMONY_SUFFIX) and has_prompt_column(p))
    return files


def convert_files(paths: Sequence, overwrite: bool = False, tokenizer=None, reasoning_effort: str = REASONING_EFFORT,
                  date: str = DATE, progress: bool = True, tokenizer_source: str = "") -> list[Path]:
    """Checks every input and output first, then writes every X_harmony.csv (all or none); returns the outputs.

    tokenizer: a loaded tokenizer, or None to load one from `tokenizer_source` ("" = the default).
    """
    from tqdm import tqdm

    check_reasoning_effort(reasoning_effort)
    check_date(date)
    files = expand_paths(paths)
    if not files:
        raise InputError(", ".join(str(p) for p in paths) or "<no paths>", "no CSV with a prompt column")
    targets = [harmony_output_path(p) for p in files]
    existing = [t for t in targets if t.exists() or t.is_symlink()]
    if existing and not overwrite:
        raise InputError(existing[0], f"output exists ({len(existing)} in all); pass --OVERWRITE to replace")
    frames = []
    for path in files:
        frame = read_csv_table(path)
        frames.append((frame, legacy_parts(frame, path)))
    tokenizer = tokenizer if tokenizer is not None else get_tokenizer(tokenizer_source)
    total = sum(len(parts) for _, parts in frames)
    outputs = []
    with tqdm(total=total, desc="Harmony prompts", unit="row", disable=not progress) as bar:
        for (frame, parts), target in zip(frames, targets, strict=True):
            rendered = []
            for system, user in parts:
                rendered.append(render_harmony_prompt(system, user, tokenizer, reasoning_effort, date))
                bar.update(1)
            out = frame.copy()
            out["prompt"] = rendered
            outputs.append((target, csv_writer(out)))
    return write_files_atomic(outputs, suffix=".csv")


def main(argv: list[str] | None = None) -> int:
    from tes_grpo.script_config import resolve

    settings = resolve(globals(), argv, positional="PATHS")
    try:
        check_reasoning_effort(settings.REASONING_EFFORT)
        check_date(settings.DATE)
        if settings.TOKENIZER:
            check_tokenizer_source(settings.TOKENIZER)
    except ValueError as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    try:
        written = convert_files(settings.PATHS, settings.OVERWRITE, None, settings.REASONING_EFFORT, settings.DATE,
                                tokenizer_source=settings.TOKENIZER)
    except InputError as err:
        print(f"error: {err}", file=sys.stderr)
        return 1
    except ValueError as err:  # the tokenizer could not be loaded, or its template cannot pin the date
        print(f"error: {err}", file=sys.stderr)
        return 2
    print(f"tokenizer: {resolve_tokenizer_source(settings.TOKENIZER)}; reasoning effort {settings.REASONING_EFFORT}; "
          f"date {settings.DATE}")
    for path in written:
        print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
