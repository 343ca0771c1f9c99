"""A training run's folder (runs/<name>/): checkpoint names, resume, and the logs a resumed run trims.

What a run leaves there: checkpoint-000020-style folders (zero-padded so they sort by name), train_config.json,
metrics.jsonl (one JSON line per step, appended), completions.csv (every completion, appended), tensorboard/,
and at the end the adapter. Everything here runs before the (slow) model load, so a bad folder fails in seconds.

Torn files: a run killed while writing (disk full, SIGKILL) can leave a last line of metrics.jsonl or a last row
of completions.csv cut short, or a checkpoint whose trainer_state.json is incomplete. Resume drops a torn last line
or row and says so, and falls back to the newest complete checkpoint, saying which one it skipped.
"""

from __future__ import annotations

import csv
import io
import json
import os
import re
import shutil
from pathlib import Path

from tes_grpo.fileio import InputError, atomic_write_text

CHECKPOINT_DIGITS = 6  # checkpoint-000020
CHECKPOINT_RE = re.compile(r"^checkpoint-(\d+)$")
RUN_FILES = ("metrics.jsonl", "completions.csv", "adapter_model.safetensors")
_NO = ("", "0", "false", "no", "off")
_LAST = ("1", "true", "yes", "on", "last")


def padded_checkpoint_name(step: int) -> str:
    return f"checkpoint-{step:0{CHECKPOINT_DIGITS}d}"


def rename_checkpoint(output_dir: Path, step: int) -> None:
    """checkpoint-N (the Trainer's name) -> checkpoint-00000N. transformers finds the newest checkpoint and rotates
    old ones by the integer after "checkpoint-", so int("000020") keeps both working."""
    plain = Path(output_dir) / f"checkpoint-{step}"
    padded = Path(output_dir) / padded_checkpoint_name(step)
    if plain == padded or not plain.is_dir():
        return
    if padded.exists():
        shutil.rmtree(padded)  # a stale copy of the same step from an earlier attempt
    os.replace(plain, padded)


def checkpoint_step(checkpoint: Path) -> int:
    """The global_step in a checkpoint's trainer_state.json; raises InputError when the file is torn or lacks it."""
    path = Path(checkpoint) / "trainer_state.json"
    try:
        return int(json.loads(path.read_text(encoding="utf-8"))["global_step"])
    except (OSError, UnicodeDecodeError, json.JSONDecodeError, KeyError, TypeError, ValueError) as err:
        raise InputError(path, f"is not a complete trainer state ({type(err).__name__}: {err})") from None


def checkpoints_in(out: Path) -> list[tuple[int, Path]]:
    """(step, folder) of every checkpoint folder in out that has a trainer_state.json, oldest first."""
    found = []
    if Path(out).is_dir():
        for child in Path(out).iterdir():
            match = CHECKPOINT_RE.match(child.name)
            if match and child.is_dir() and (child / "trainer_state.json").is_file():
                found.append((int(match.group(1)), child))
    return sorted(found)


def newest_complete_checkpoint(out: Path, say=print) -> Path | None:
    """The newest checkpoint whose trainer_state.json reads; says which newer ones it skipped and why."""
    for _, folder in reversed(checkpoints_in(out)):
        try:
            checkpoint_step(folder)
        except InputError as err:
            say(f"resume: skipping {folder.name}: {err}")
            continue
        return folder
    return None


def resume_checkpoint(out: Path, resume: str, say=print) -> Path | None:
    """The checkpoint RESUME asks for ("" new run, "1" newest complete one in out, or a folder), or None for a new
    run. A new run refuses a folder that already holds one."""
    out = Path(out)
    resume = str(resume).strip()
    if resume.lower() in _NO:
        existing = checkpoints_in(out)
        leftovers = [name for name in RUN_FILES if (out / name).exists()]
        if existing or leftovers:
            raise InputError(out, "already holds a run (" + ", ".join([p.name for _, p in existing[-1:]] + leftovers)
                             + "); pass --RESUME=1 to continue it, or choose another --OUT_DIR")
        return None
    if resume.lower() in _LAST:
        checkpoint = newest_complete_checkpoint(out, say)
        if checkpoint is None:
            raise InputError(out, "RESUME=1 but there is no complete checkpoint-* folder to resume from")
        return checkpoint
    path = Path(resume)
    if not (path / "trainer_state.json").is_file():
        raise InputError(path, "RESUME names a folder without trainer_state.json (not a checkpoint)")
    checkpoint_step(path)
    return path


def checkpoint_processes(checkpoint: Path) -> int | None:
    """How many processes wrote the checkpoint (one rng_state_<rank>.pth each; rng_state.pth for one); None if it
    has no RNG state."""
    ranked = list(Path(checkpoint).glob("rng_state_*.pth"))
    if ranked:
        return len(ranked)
    return 1 if (Path(checkpoint) / "rng_state.pth").is_file() else None


def check_resume_processes(checkpoint: Path, processes: int) -> None:
    """A run resumes with the number of processes that wrote its checkpoint: the prompt stream's draws and every
    rank's RNG state depend on it."""
    wrote = checkpoint_processes(checkpoint)
    if wrote is not None and wrote != processes:
        how = f"accelerate launch --num_processes {wrote}" if wrote > 1 else "python train_grpo.py"
        raise InputError(checkpoint, f"was written by {wrote} process(es), this run has {processes}; resume it "
                         f"with {wrote} ({how})")


def read_exactly(path) -> str:
    """The file's text with its line ends as written: completions can hold a bare \\r, which universal newlines
    (Path.read_text) would turn into \\n, changing the rows a resume keeps. A write cut inside a multi-byte
    character leaves one replaced character, in the torn row that is dropped anyway."""
    with open(path, encoding="utf-8", errors="replace", newline="") as handle:
        return handle.read()


def read_metrics(path: Path, say=print) -> list[dict]:
    """metrics.jsonl's records; a torn last line (a write cut short) is dropped with a note, any other bad line is
    an InputError naming the line."""
    lines = Path(path).read_text(encoding="utf-8", errors="replace").splitlines()
    records = []
    for number, line in enumerate(lines, start=1):
        if not line.strip():
            continue
        try:
            records.append(json.loads(line))
        except json.JSONDecodeError as err:
            if number == len(lines):
                say(f"resume: {path}: dropping the torn last line {number} ({err.msg})")
                continue
            raise InputError(path, f"line {number} is not JSON ({err.msg}): {line[:80]!r}") from None
    return records


def read_completion_log(path: Path, say=print) -> tuple[list[str], list[list[str]], bool]:
    """(header, rows, torn?) of completions.csv; a torn last row (too few fields, or an unclosed quoted field) is
    dropped with a note, a short row elsewhere is an InputError naming the row."""
    text = read_exactly(path)
    try:
        rows = list(csv.reader(io.StringIO(text, newline="")))
        torn_quote = False
    except csv.Error:
        rows, torn_quote = [], True
    torn = torn_quote or bool(text and not text.endswith("\n"))
    if torn or (text and not text.endswith("\n")):
        # cut mid-row: parse what precedes the last line break, the rest is the torn row
        head = text[:text.rfind("\n") + 1]
        rows = list(csv.reader(io.StringIO(head, newline="")))
        say(f"resume: {path}: dropping a torn last row (the file did not end with a complete row)")
    if not rows:
        return [], [], torn
    header, body = rows[0], rows[1:]
    for number, row in enumerate(body, start=2):
        if len(row) != len(header):
            if number == len(body) + 1:
                say(f"resume: {path}: dropping the torn last row {number} ({len(row)} of {len(header)} fields)")
                body, torn = body[:-1], True
                break
            raise InputError(path, f"row {number} has {len(row)} fields, the header {len(header)}")
    return header, body, torn


def drop_log_rows_after(out: Path, step: int, completion_log: Path | None, say=print) -> None:
    """On resume, keeps only metrics lines and completion-log rows of steps up to the checkpoint's (the rest will
    be redone), and drops torn last lines/rows; rewrites each file atomically, and only when something changes."""
    metrics = Path(out) / "metrics.jsonl"
    if metrics.is_file():
        original = metrics.read_text(encoding="utf-8", errors="replace")
        kept = [record for record in read_metrics(metrics, say) if record.get("step", 0) <= step]
        text = "".join(json.dumps(record) + "\n" for record in kept)
        if text != original:
            atomic_write_text(metrics, text)
            dropped = len([line for line in original.splitlines() if line.strip()]) - len(kept)
            if dropped:
                say(f"resume: dropped {dropped} metrics line(s) after step {step} (or torn)")
    if completion_log is not None and Path(completion_log).is_file() and Path(completion_log).stat().st_size > 0:
        header, rows, torn = read_completion_log(completion_log, say)
        step_column = header.index("step") if "step" in header else None
        if step_column is None:
            raise InputError(completion_log, "has no 'step' column (not a completion log)")
        kept_rows = []
        for number, row in enumerate(rows, start=2):
            try:
                if int(row[step_column]) <= step:
                    kept_rows.append(row)
            except ValueError:
                raise InputError(completion_log, f"row {number}, column step: not a step number "
                                 f"{row[step_column]!r}") from None
        if torn or len(kept_rows) != len(rows):
            buffer = io.StringIO()
            csv.writer(buffer, lineterminator="\n", quoting=csv.QUOTE_ALL).writerows([header, *kept_rows])
            atomic_write_text(completion_log, buffer.getvalue())
            if len(kept_rows) != len(rows):
                say(f"resume: dropped {len(rows) - len(kept_rows)} completion-log row(s) after step {step}")


def prepare_resume(out: Path, resume: str, completion_log: Path | None, processes: int, say=print, trim: bool = True,
                   total_steps: int | None = None):
    """Everything resume needs that reads only files, done before the model load: the checkpoint (or None for a
    new run), its process count checked, its step, and (trim: the main process only) the logs trimmed to it, unless
    the checkpoint is already at total_steps: then nothing will be trained again and the run folder stays as it is.
    Returns (checkpoint, step)."""
    checkpoint = resume_checkpoint(out, resume, say)
    if checkpoint is None:
        return None, 0
    check_resume_processes(checkpoint, processes)
    step = checkpoint_step(checkpoint)
    if trim and (total_steps is None or step < total_steps):
        drop_log_rows_after(out, step, completion_log, say)
    return checkpoint, step


def run_summary(settings, layout: dict, extra: dict, processes: int) -> dict:
    """The resolved settings plus what was derived from them, as written to train_config.json."""
    import sys

    import peft
    import torch
    import transformers
    import trl

    versions = {"python": sys.version.split()[0], "torch": torch.__version__, "transformers": transformers.__version__,
                "trl": trl.__version__, "peft": peft.__version__}
    return {**settings, "derived": {**layout, **extra, "processes": processes, "versions": versions,
                                    "preset": {k: v[1] for k, v in settings.preset.items()}}}
