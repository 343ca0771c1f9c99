"""Kill-and-resume drill: SIGKILLs real train_grpo.py runs mid-step and mid-save, resumes each with --RESUME=1, and
compares every run with an uninterrupted one. Not collected by pytest (it launches several whole runs); run it
where the question is asked, on the GPU machine or here:

    .venv/bin/python tests/kill_resume_drill.py                       # the tiny model, CPU or GPU, a few minutes
    .venv/bin/python tests/kill_resume_drill.py --MODEL_ID=/path/to/20b-shaped-checkpoint --MAX_COMPLETION_LEN=64 \
        --PARALLEL=1 --EXTRA=--MEMORY_BUDGET_GB=20                    # three 20B runs at once on one 80 GB GPU

Each drill: the reference run trains TOTAL_STEPS uninterrupted; a second run is killed (SIGKILL to its process
group) at the drill's moment, then resumed in the same folder until it finishes. Checked, for each drill:
- the resumed run finishes (exit 0, trainer_state.json at TOTAL_STEPS, the adapter written);
- the completion log holds every step once (no row duplicated, no step missing) and its rows up to the checkpoint
  resumed from are the killed run's rows, byte for byte;
- and reported, not required: whether the completions, rewards and final adapter equal the uninterrupted run's
  (on a CPU they do; on a GPU, nondeterministic kernels may make later steps differ).
The moments: `mid-step` kills while the step after KILL_AFTER_STEP runs (KILL_AT of a step's time after its line);
`mid-save` kills as soon as the Trainer's checkpoint folder for step SAVE_STEPS*2 appears, before it is complete;
`oom` (GPU only) caps the process's GPU memory just above what it holds when step KILL_AFTER_STEP+1 begins
(torch.cuda.set_per_process_memory_fraction), so that step runs out of memory: the run must stop with one
"error: out of GPU memory in step ..." line and exit 1, and --RESUME=1 (uncapped) must finish it. Prints a table
last; writes each run's output under OUT_DIR. Exits 1 if a check fails.
"""

from __future__ import annotations

import csv
import hashlib
import os
import signal
import subprocess
import sys
import time
from collections import Counter
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path

_REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(_REPO))

from transformers import TrainerCallback  # noqa: E402

from tes_grpo.run.script_config import resolve  # noqa: E402

MODEL_ID = "tiny"  # train_grpo.py's MODEL_ID
OUT_DIR = "runs/kill-resume-drill"  # one folder per run under it (emptied first)
TOTAL_STEPS = 6  # optimizer steps of each run
SAVE_STEPS = 2  # checkpoint every this many steps
KILL_AFTER_STEP = 3  # mid-step: kill while the step after this one runs (the checkpoint resumed from: step 2)
KILL_AT = 0.5  # mid-step: how far into the next step to kill, as a share of the time the previous step took
MAX_COMPLETION_LEN = 48  # tokens per completion
NUM_GENERATIONS = 8  # completions per prompt
DRILLS = ["mid-step", "mid-save", "oom"]  # which kills to try (oom: GPU only, skipped without CUDA)
TIMEOUT_S = 1800  # a run that takes longer is stopped and counted as failed
PARALLEL = False  # run the drills alongside the uninterrupted run (a GPU with room for several copies of the model)
EXTRA = ""  # more train_grpo.py overrides for every run, space-separated (e.g. "--MEMORY_BUDGET_GB=20")


def train_command(s, out: Path, resume: bool) -> list[str]:
    return [sys.executable, str(_REPO / "train_grpo.py"), f"--MODEL_ID={s.MODEL_ID}", f"--OUT_DIR={out}",
            f"--TOTAL_STEPS={s.TOTAL_STEPS}", f"--SAVE_STEPS={s.SAVE_STEPS}", f"--NUM_GENERATIONS={s.NUM_GENERATIONS}",
            f"--MAX_COMPLETION_LEN={s.MAX_COMPLETION_LEN}", "--GRADIENT_ACCUMULATION_STEPS=2", "--REPORT_TO=none",
            *s.EXTRA.split(), *(["--RESUME=1"] if resume else [])]


def start(command: list[str], log: Path) -> subprocess.Popen:
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    return subprocess.Popen(command, cwd=_REPO, stdout=log.open("w"), stderr=subprocess.STDOUT, env=env,
                            start_new_session=True)  # its own process group: the kill reaches every child


def kill(process: subprocess.Popen) -> None:
    try:
        os.killpg(process.pid, signal.SIGKILL)
    except ProcessLookupError:  # it ended by itself (the drill reports that as not stopped as planned)
        pass
    process.wait()


def wait_for(condition, process: subprocess.Popen, timeout: float, poll: float = 0.01) -> bool:
    """Polls condition() until it holds (True) or the process ended or the time ran out (False)."""
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        if condition():
            return True
        if process.poll() is not None:
            return condition()
        time.sleep(poll)
    return False


def step_line_seen(log: Path, step: int, total: int):
    return lambda: f"step {step}/{total} " in log.read_text(errors="replace")


def save_started(out: Path, step: int):
    """The Trainer writes checkpoint-N (unpadded) and ZeroPaddedCheckpointNames renames it once it is complete."""
    return lambda: (out / f"checkpoint-{step}").exists()


def finish(process: subprocess.Popen, timeout: float) -> int:
    try:
        return process.wait(timeout=timeout)
    except subprocess.TimeoutExpired:
        kill(process)
        return -9


def log_rows(out: Path) -> list[str]:
    """completions.csv's data rows as text (header dropped), in file order."""
    path = out / "completions.csv"
    if not path.exists():
        return []
    with path.open(newline="", encoding="utf-8") as f:
        rows = list(csv.reader(f))
    return ["\x1f".join(row) for row in rows[1:]]


def step_of(row: str, header: list[str]) -> int:
    return int(row.split("\x1f")[header.index("step")])


def header_of(out: Path) -> list[str]:
    with (out / "completions.csv").open(newline="", encoding="utf-8") as f:
        return next(csv.reader(f))


def digest(path: Path) -> str | None:
    return hashlib.sha256(path.read_bytes()).hexdigest()[:12] if path.exists() else None


def global_step(out: Path) -> int | None:
    import json

    path = out / "trainer_state.json"
    return json.loads(path.read_text())["global_step"] if path.exists() else None


class CapMemoryAt(TrainerCallback):
    """When optimizer step `step` begins: frees the allocator's cache and caps the process's GPU memory a little above
    what it holds, so the step's next large allocation fails (torch.OutOfMemoryError)."""

    def __init__(self, step: int):
        self.step = step

    def on_step_begin(self, args, state, control, **kwargs):
        import torch

        if state.global_step + 1 == self.step:
            torch.cuda.empty_cache()
            total = torch.cuda.get_device_properties(0).total_memory
            torch.cuda.set_per_process_memory_fraction((torch.cuda.memory_reserved() + (16 << 20)) / total)


def capped_run(argv: list[str], step: int) -> int:
    """train_grpo.main(argv) with CapMemoryAt(step): what the oom drill runs in a fresh process."""
    import train_grpo

    return train_grpo.main(argv, callbacks=[CapMemoryAt(step)])


def capped_command(s, out: Path) -> list[str]:
    argv = train_command(s, out, resume=False)[2:]
    code = (f"import sys; sys.path.insert(0, {str(Path(__file__).parent)!r}); import kill_resume_drill as d; "
            f"sys.exit(d.capped_run({argv!r}, {s.KILL_AFTER_STEP + 1}))")
    return [sys.executable, "-c", code]


def drill(s, name: str, root: Path, reference: Path, reference_run: Future) -> dict:
    """Kills (or caps) a run at the drill's moment, resumes it, and checks it against the uninterrupted run, once
    reference_run (its exit code) is done."""
    out = root / name
    first_log, resumed_log = root / f"{name}-killed.log", root / f"{name}-resumed.log"
    process = start(capped_command(s, out) if name == "oom" else train_command(s, out, resume=False), first_log)
    if name == "oom":
        code = finish(process, s.TIMEOUT_S)
        errors = [line for line in first_log.read_text(errors="replace").splitlines() if line.startswith("error:")]
        reached = alive = code == 1 and len(errors) == 1 and errors[0].startswith(
            f"error: out of GPU memory in step {s.KILL_AFTER_STEP + 1} ") and "Traceback" not in first_log.read_text()
        moment = f"memory capped at step {s.KILL_AFTER_STEP + 1}: " + (errors[0][:160] if errors else "no error line")
    elif name == "mid-step":
        reached = wait_for(step_line_seen(first_log, s.KILL_AFTER_STEP - 1, s.TOTAL_STEPS), process, s.TIMEOUT_S)
        before = time.monotonic()
        reached = reached and wait_for(step_line_seen(first_log, s.KILL_AFTER_STEP, s.TOTAL_STEPS), process,
                                       s.TIMEOUT_S)
        took = time.monotonic() - before  # a GPU step can take under a second: kill relative to it
        time.sleep(s.KILL_AT * took)
        moment = f"{s.KILL_AT * took:.2f} s after step {s.KILL_AFTER_STEP}'s line (a step took {took:.2f} s)"
    else:
        reached = wait_for(save_started(out, 2 * s.SAVE_STEPS), process, s.TIMEOUT_S, poll=0.001)
        moment = f"checkpoint-{2 * s.SAVE_STEPS} being written"
    if name != "oom":
        alive = process.poll() is None
        if not alive:
            moment += f" (not reached: the run ended by itself, exit {process.returncode})"
        kill(process)
    header = header_of(out)
    killed_rows = log_rows(out)
    partial = sorted(p.name for p in out.glob("checkpoint-*") if not (p / "trainer_state.json").exists())
    done = start(train_command(s, out, resume=True), resumed_log)
    code = finish(done, s.TIMEOUT_S)
    resumed_text = resumed_log.read_text(errors="replace")
    resumed_from = next((int(line.split(" at step ")[1].split()[0]) for line in resumed_text.splitlines()
                         if line.startswith("resuming from ")), None)
    rows = log_rows(out)
    steps = [step_of(r, header) for r in rows]
    reference_run.result()
    reference_rows = log_rows(reference)
    kept = [r for r in killed_rows if resumed_from is not None and step_of(r, header) <= resumed_from]
    checks = {
        "stopped as planned": reached and alive,  # killed in time; oom: one out-of-memory line and exit 1
        "resumed run finished": code == 0 and global_step(out) == s.TOTAL_STEPS and (out / "adapter_model.safetensors")
        .exists(),
        # as many rows a step as the uninterrupted run (a group's completions may repeat, so rows are not unique)
        "every step once": sorted(set(steps)) == list(range(1, s.TOTAL_STEPS + 1))
        and Counter(steps) == Counter(step_of(r, header) for r in reference_rows),
        "log before the checkpoint untouched": resumed_from is not None and rows[:len(kept)] == kept,
    }
    return {"drill": name, "moment": moment, "partial checkpoint left": ", ".join(partial) or "none",
            "resumed from step": resumed_from, "exit": code, **checks,
            "log equal to uninterrupted": rows == reference_rows,
            "adapter equal to uninterrupted": digest(out / "adapter_model.safetensors")
            == digest(reference / "adapter_model.safetensors")}


def main(argv: list[str] | None = None) -> int:
    import shutil

    s = resolve(globals(), argv)
    from benchmarks.log_header import header

    print(header(), flush=True)
    root = Path(s.OUT_DIR)
    if not root.is_absolute():
        root = _REPO / root
    shutil.rmtree(root, ignore_errors=True)
    root.mkdir(parents=True)
    reference = root / "uninterrupted"
    import torch

    drills = [name for name in s.DRILLS if name != "oom" or torch.cuda.is_available()]
    if drills != list(s.DRILLS):
        print("oom drill skipped: it caps GPU memory, and there is no CUDA device here")
    with ThreadPoolExecutor(max_workers=1 + len(drills) if s.PARALLEL else 1) as pool:
        # one worker runs them in order, the uninterrupted run first
        reference_run = pool.submit(lambda: finish(start(train_command(s, reference, resume=False),
                                                         root / "uninterrupted.log"), s.TIMEOUT_S))
        if not s.PARALLEL and reference_run.result() != 0:
            drills = []
        results = [future.result() for future in
                   [pool.submit(drill, s, name, root, reference, reference_run) for name in drills]]
    if reference_run.result() != 0:
        print(f"error: the uninterrupted run failed (exit {reference_run.result()}); see "
              f"{root / 'uninterrupted.log'}", file=sys.stderr)
        return 1
    required = ("stopped as planned", "resumed run finished", "every step once", "log before the checkpoint untouched")
    print(f"\nkill-and-resume drill: MODEL_ID={s.MODEL_ID}, {s.TOTAL_STEPS} steps, checkpoint every {s.SAVE_STEPS}; "
          f"logs under {root}")
    for result in results:
        print(" | ".join(f"{key}: {value}" for key, value in result.items()))
    failed = [f"{r['drill']}: {key}" for r in results for key in required if not r[key]]
    print("FAILED: " + "; ".join(failed) if failed else "all required checks passed")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
