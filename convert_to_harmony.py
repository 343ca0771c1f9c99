"""Renders legacy two-part prompts (`system:` / `user:`) into gpt-oss Harmony text with the chat template.

    python convert_to_harmony.py data/train/X_q_dataset.csv [more.csv or folders ...] [--overwrite]

For each X.csv it writes X_harmony.csv beside it: the `prompt` column rendered by the tokenizer's own chat
template (the `system` part becomes gpt-oss's developer "# Instructions", the `user` part the user message,
the generation prompt `<|start|>assistant` appended); every other column is kept as the same text.
A folder means every CSV below it with a `prompt` column, except *_harmony.csv files.
The template prints "Current date: <today>"; the date is pinned (DATE) by replacing the template's
strftime_now call with that literal, so outputs are reproducible. (transformers hands templates only
plain data, so a strftime_now callable cannot be passed as a template kwarg.)
Refuses an existing output without --overwrite, and a prompt that is already Harmony (starts with
<|start|>). Every file is checked before anything is written.
"""

from __future__ import annotations

import re
import sys
from pathlib import Path
from typing import Sequence

from tes_grpo.fileio import InputError, write_csv_atomic
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


def get_tokenizer(source: str = ""):
    from tes_grpo.gpt_oss_tokenizer import load_tokenizer

    return load_tokenizer(resolve_tokenizer_source(source))


def pinned_date_template(template: str, date: str) -> str:
    """The chat template with its one strftime_now("%Y-%m-%d") call replaced by the literal `date`."""
    if not re.fullmatch(r"\d{4}-\d{2}-\d{2}", date):
        raise ValueError(f"DATE must look like YYYY-MM-DD, got {date!r}")
    count = template.count(_TEMPLATE_DATE_CALL)
    if count != 1:
        raise ValueError(f"the chat template calls {_TEMPLATE_DATE_CALL} {count} times, expected exactly once; "
                         "cannot pin the date")
    return template.replace(_TEMPLATE_DATE_CALL, f'"{date}"')


def render_harmony_prompt(system: str, user: str, tokenizer=None, reasoning_effort: str = REASONING_EFFORT,
                          date: str = DATE) -> str:
    """Harmony text of a developer (`system`) + user conversation, ending with `<|start|>assistant`."""
    if reasoning_effort not in _REASONING_EFFORTS:
        raise ValueError(f"reasoning effort must be one of {', '.join(_REASONING_EFFORTS)}, got {reasoning_effort!r}")
    tokenizer = tokenizer if tokenizer is not None else get_tokenizer(TOKENIZER)
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
    import csv

    with path.open(newline="", encoding="utf-8") as handle:
        return "prompt" in next(csv.reader(handle), [])


def expand_paths(paths: Sequence) -> list[Path]:
    files = []
    for raw in paths:
        path = Path(raw)
        if path.is_dir():
            files += [p for p in sorted(path.rglob("*.csv"))
                      if not p.stem.endswith(_HARMONY_SUFFIX) and has_prompt_column(p)]
        elif path.is_file():
            files.append(path)
        else:
            raise InputError(path, "no such file or folder")
    return files


def convert_files(paths: Sequence, overwrite: bool = False, tokenizer=None,
                  reasoning_effort: str = REASONING_EFFORT, date: str = DATE, progress: bool = True) -> list[Path]:
    """Checks every input and output first, then writes each X_harmony.csv; returns the outputs."""
    import pandas as pd
    from tqdm import tqdm

    files = expand_paths(paths)
    if not files:
        raise InputError(", ".join(str(p) for p in paths) or "<no paths>", "no CSV with a prompt column")
    targets = [harmony_output_path(p) for p in files]
    existing = [t for t in targets if t.exists()]
    if existing and not overwrite:
        raise InputError(existing[0], f"output exists ({len(existing)} in all); pass --overwrite to replace")
    frames = []
    for path in files:
        try:
            frame = pd.read_csv(path, dtype=str, keep_default_na=False, na_filter=False)
        except (OSError, pd.errors.ParserError, pd.errors.EmptyDataError, UnicodeDecodeError) as err:
            raise InputError(path, f"cannot read as CSV: {err}") from None
        frames.append((frame, legacy_parts(frame, path)))
    tokenizer = tokenizer if tokenizer is not None else get_tokenizer(TOKENIZER)
    total = sum(len(parts) for _, parts in frames)
    written = []
    with tqdm(total=total, desc="Harmony prompts", unit="row", disable=not progress) as bar:
        for (frame, parts), target in zip(frames, targets):
            rendered = []
            for system, user in parts:
                rendered.append(render_harmony_prompt(system, user, tokenizer, reasoning_effort, date))
                bar.update(1)
            out = frame.copy()
            out["prompt"] = rendered
            written.append(write_csv_atomic(out, target))
    return written


def main() -> None:
    from tes_grpo.script_config import configure

    configure(globals(), positional="PATHS")
    try:
        written = convert_files(PATHS, OVERWRITE, None, REASONING_EFFORT, DATE)
    except (InputError, ValueError) as err:
        print(f"error: {err}", file=sys.stderr)
        sys.exit(1)
    print(f"tokenizer: {resolve_tokenizer_source(TOKENIZER)}; reasoning effort {REASONING_EFFORT}; date {DATE}")
    for path in written:
        print(f"wrote {path}")


if __name__ == "__main__":
    main()
