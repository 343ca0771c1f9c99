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

import sys
from pathlib import Path
from typing import Sequence

from tes_grpo.run.fileio import (
    InputError,
    csv_files,
    csv_writer,
    read_csv_header,
    read_csv_table,
    write_files_atomic,
)
from tes_grpo.task.harmony import DATASET_DATE as _DATASET_DATE
from tes_grpo.task.harmony import DATASET_REASONING_EFFORT as _DATASET_EFFORT
from tes_grpo.task.harmony import HARMONY_SUFFIX as _HARMONY_SUFFIX
from tes_grpo.task.harmony import (
    check_date,
    check_reasoning_effort,
    harmony_output_path,
    is_harmony,
    load_tokenizer,
    render_harmony_prompt,
    tokenizer_source,
)
from tes_grpo.task.task_prompt import parse_legacy_prompt

PATHS: list = []  # legacy-prompt CSV files or folders (positional arguments)
TOKENIZER = ""  # tokenizer folder or hub id; "" = GPT_OSS_TOKENIZER, else ../shared/gpt-oss-tokenizer, else the Hub
REASONING_EFFORT = _DATASET_EFFORT  # the template's "Reasoning:" line: low, medium or high
DATE = _DATASET_DATE  # the "Current date:" the template prints (YYYY-MM-DD), pinned for reproducible outputs
OVERWRITE = False  # replace existing *_harmony.csv outputs


def resolve_tokenizer_source(source: str = "") -> str:
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
    """The tokenizer from `source` ("" = the default, whose errors name GPT_OSS_TOKENIZER: harmony.load_tokenizer);
    ValueError naming TOKENIZER if the one it names cannot be loaded."""
    if not source:
        return load_tokenizer()
    resolved = resolve_tokenizer_source(source)
    check_tokenizer_source(resolved)
    local = Path(resolved).expanduser()
    try:
        return load_tokenizer(str(local) if local.exists() else resolved)
    except (OSError, ValueError) as err:
        first_line = str(err).strip().splitlines()[0] if str(err).strip() else type(err).__name__
        raise ValueError(f"--TOKENIZER={resolved!r}: cannot load a tokenizer from it ({first_line})") from None


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
    from tes_grpo.run.script_config import resolve

    settings = resolve(globals(), argv, positional="PATHS")
    if not settings.PATHS:
        print("error: no input: name the legacy-prompt CSV files or folders to convert "
              "(python convert_to_harmony.py data/my_q_dataset.csv)", file=sys.stderr)
        return 2
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
