"""A training run's folder (runs/<name>/): checkpoint names, resume, the logs a resumed run trims, the best
checkpoint's record (what the folder says about its adapter and settings: adapter_folder.py).

What a run leaves there:
- train_config.json: the resolved settings and what was derived from them (batch layout, versions, preset);
- metrics.jsonl: one JSON line per logged step and per evaluation (appended), then one summary line of the
  Trainer's (train_runtime, train_loss, ...) at the end of each run or resumed run;
- completions.csv: every training completion with its reward (appended; data_reward.CompletionLog);
- best_checkpoint.json: which checkpoint evaluated best (BEST_METRIC), and training.png (plot.py);
- tensorboard/: the same metrics for TensorBoard (REPORT_TO);
- checkpoint-000020-style folders (zero-padded so they sort by name) every SAVE_STEPS and at each evaluation: the
  adapter and tokenizer as below, plus optimizer.pt, scheduler.pt, rng_state*.pth, trainer_state.json and
  training_args.bin;
- at the end: the adapter (adapter_config.json, adapter_model.safetensors), the tokenizer (tokenizer.json,
  tokenizer_config.json, chat_template.jinja), PEFT's model card README.md, trainer_state.json and
  training_args.bin (the Trainer's arguments, pickled by transformers).
Everything here runs before the (slow) model load, so a bad folder fails in seconds.

The best checkpoint: `best_record` says which one from a trainer state (HF Trainer's best_model_checkpoint, chosen
by BEST_METRIC at each evaluation), `write_best_record` puts it in best_checkpoint.json (adapter_folder.py's
`resolve_adapter_path` turns `<run folder>/best` into it). A resumed run rewrites the record from the checkpoint it
resumes (the evaluations after it will be redone).

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
import sys
from pathlib import Path

from tes_grpo.run.fileio import InputError, atomic_write_text

CHECKPOINT_DIGITS = 6  # checkpoint-000020
CHECKPOINT_RE = re.compile(r"^checkpoint-(\d+)$")
ADAPTER_CONFIG = "adapter_config.json"
ADAPTER_WEIGHTS = "adapter_model.safetensors"  # PEFT's default format; the only one the exporters read
BEST_RECORD = "best_checkpoint.json"  # the checkpoint that evaluated best: step, folder, metric, value, evaluation
RUN_FILES = ("metrics.jsonl", "completions.csv", ADAPTER_WEIGHTS)
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


def starting_over(out: Path) -> str:
    """What a plain run (no --RESUME) does with `out` when there is no checkpoint to continue from."""
    out = Path(out)
    leftovers = [name for name in RUN_FILES if (out / name).exists()]
    if not leftovers:
        return f"{out} holds no run yet: a plain run (without --RESUME) starts one there"
    return (f"the run in {out} stopped before its first checkpoint, so it cannot be continued: a plain run (without "
            f"--RESUME) starts over there once its {', '.join(leftovers)} are removed, or in another --OUT_DIR")


def how_to_go_on(out: Path) -> str:
    """How a run stopped in `out` (Ctrl-C, out of memory) goes on: --RESUME=1 from its newest complete checkpoint,
    or, with none written yet, what a plain run does (starting_over)."""
    out = Path(out)
    checkpoint = newest_complete_checkpoint(out, say=lambda line: None) if out.is_dir() else None
    if checkpoint is None:
        return f"no checkpoint was written yet; {starting_over(out)}"
    return (f"--RESUME=1 continues from {checkpoint} (step {checkpoint_step(checkpoint)}); the rows of later steps in "
            "the logs are dropped then")


def resume_checkpoint(out: Path, resume: str, say=print) -> Path | None:
    """The checkpoint RESUME asks for ("" new run, "1" newest complete one in out, or a folder), or None for a new
    run. A new run refuses a folder that already holds one, saying whether it finished (then a new run needs another
    folder) or can be continued; RESUME=1 without a checkpoint says what a plain run does instead."""
    out = Path(out)
    resume = str(resume).strip()
    if resume.lower() in _NO:
        existing = checkpoints_in(out)
        leftovers = [name for name in RUN_FILES if (out / name).exists()]
        held = ", ".join([p.name for _, p in existing[-1:]] + leftovers)
        if (out / ADAPTER_WEIGHTS).exists():  # written after the last step: the run finished
            raise InputError(out, f"already holds a finished run ({held}); a new run needs another --OUT_DIR, and "
                             "--RESUME=1 with a higher --TOTAL_STEPS trains this one on")
        if existing or leftovers:
            raise InputError(out, f"already holds a run ({held}); pass --RESUME=1 to continue it, or choose another "
                             "--OUT_DIR")
        return None
    if resume.lower() in _LAST:
        checkpoint = newest_complete_checkpoint(out, say)
        if checkpoint is None:
            raise InputError(out, f"RESUME=1 but there is no complete checkpoint-* folder to resume from; "
                             f"{starting_over(out)}")
        return checkpoint
    path = Path(resume)
    if not (path / "trainer_state.json").is_file():
        raise InputError(path, "RESUME names a folder without trainer_state.json (not a checkpoint)")
    checkpoint_step(path)
    return path


def where_stopped(total_steps: int, step: int | None, ended: bool) -> str:
    """Where a training run stopped: in the optimizer step in progress, before the first, or after the last while
    saving the adapter (ended)."""
    if ended:
        return f"after the last step ({total_steps}), while saving the adapter"
    return f"in step {step} of {total_steps}" if step is not None else "before the first training step"


def stopped_message(out: Path, total_steps: int, step: int | None, ended: bool, why: str) -> str:
    """One line for a training run that stopped (`why`: "stopped by Ctrl-C"): where, and how it goes on."""
    return f"{why} {where_stopped(total_steps, step, ended)}; {how_to_go_on(out)}"


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
        refresh_best_record(out, checkpoint, say)
    return checkpoint, step


# ---------------------------------------------------------------------------------------------------------------
# The best checkpoint (evaluation during training; run/evaluation.py)
# ---------------------------------------------------------------------------------------------------------------

def best_record(state: dict, metric: str | None) -> dict | None:
    """What best_checkpoint.json holds, from a trainer state (trainer_state.json's fields): the best checkpoint's
    step and folder, the metric (BEST_METRIC) and its value, and that evaluation's logged eval_* quantities; None
    while no evaluation has chosen a checkpoint."""
    best = state.get("best_model_checkpoint")
    if not best or state.get("best_metric") is None:
        return None
    match = re.search(r"checkpoint-(\d+)$", str(best))
    step = state.get("best_global_step") or (int(match.group(1)) if match else None)
    logged = [entry for entry in state.get("log_history", []) if entry.get("step") == step
              and any(key.startswith("eval_") for key in entry)]
    evaluation = {key: value for key, value in (logged[-1] if logged else {}).items() if key.startswith("eval_")}
    return {"step": step, "folder": padded_checkpoint_name(step) if step is not None else Path(best).name,
            "metric": metric, "value": state["best_metric"], "evaluation": evaluation}


def write_best_record(out: Path, record: dict | None) -> None:
    """best_checkpoint.json in the run folder, written atomically; no record removes it."""
    path = Path(out) / BEST_RECORD
    if record is None:
        path.unlink(missing_ok=True)
    else:
        atomic_write_text(path, json.dumps(record, indent=2, default=float) + "\n")


def read_best_record(out: Path) -> dict | None:
    """best_checkpoint.json of a run folder, None when there is none; InputError when it does not read."""
    path = Path(out) / BEST_RECORD
    if not path.is_file():
        return None
    try:
        record = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as err:
        raise InputError(path, f"does not read ({type(err).__name__}: {err})") from None
    if not isinstance(record, dict) or not isinstance(record.get("folder"), str):
        raise InputError(path, "names no checkpoint folder (not written by train_grpo.py)", column="folder")
    return record


def refresh_best_record(out: Path, checkpoint: Path, say=print) -> None:
    """On resume: best_checkpoint.json as the resumed checkpoint's trainer state has it (a record of an evaluation
    after the checkpoint, which will be redone, goes; the metric's name is kept from the old record)."""
    path = Path(checkpoint) / "trainer_state.json"
    try:
        state = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as err:
        raise InputError(path, f"is not a complete trainer state ({type(err).__name__}: {err})") from None
    try:
        old = read_best_record(out)
    except InputError as err:
        say(f"resume: replacing {err}")
        old = None
    record = best_record(state, (old or {}).get("metric"))
    if record != old:
        write_best_record(out, record)
        if old is not None:
            say(f"resume: {BEST_RECORD} now names " + (record["folder"] if record else "no checkpoint")
                + f", as {Path(checkpoint).name} recorded it (it named {old['folder']})")


def run_summary(settings, layout: dict, extra: dict, processes: int) -> dict:
    """The resolved settings plus what was derived from them, as written to train_config.json."""
    # the library versions, imported here: everything else in this module runs before them, in evaluation too
    import peft
    import torch
    import transformers
    import trl

    versions = {"python": sys.version.split()[0], "torch": torch.__version__, "transformers": transformers.__version__,
                "trl": trl.__version__, "peft": peft.__version__}
    return {**settings, "derived": {**layout, **extra, "processes": processes, "versions": versions,
                                    "preset": {k: v[1] for k, v in settings.preset.items()}}}
