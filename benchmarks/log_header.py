"""The header every benchmark, profile, GPU-suite part and drill log begins with: the command line, the commit and
whether the tree had changes, the GPU, the copy rate where the script measures it, and the library versions, so that
a log says which code, command and machine produced it. `header()` gives it; the scripts print it first.

    python benchmarks/log_header.py                     # print it (tests/gpu_suite.sh: before each part's pytest)
    python benchmarks/log_header.py --COMMAND="..."     # naming a command other than this one
    python benchmarks/log_header.py --WRITE_RECORD=1    # here, just before a run on a machine without .git

The commit. In a git checkout: `git rev-parse --short HEAD`, and `git status --porcelain` for the changes. The GPU
machine gets a copy of the working tree (tracked files and the untracked ones git does not ignore) without .git;
there the commit comes from .tree-record.json at the repo's root, which --WRITE_RECORD=1 writes here: the commit, the
changes, and a hash of every file that travels. It is git-ignored, so name it in the run's carry. On the GPU machine
the header hashes those files again and says whether the copy matches the record: a record left from an earlier
tree shows as one. With neither: "commit: unknown (no .git ...)".
"""

from __future__ import annotations

import sys as _sys
from pathlib import Path as _Path

# Run as `python benchmarks/<name>.py` from the repo root: Python puts benchmarks/ on sys.path, not the root
# that holds the tes_grpo package.
_sys.path.insert(0, str(_Path(__file__).resolve().parents[1]))

import hashlib
import json
import os
import shlex
import shutil
import subprocess
from collections import Counter
from datetime import datetime, timezone
from pathlib import Path

from tes_grpo.run.script_config import resolve

COMMAND = ""  # the command line to name; empty: this process's own (sys.orig_argv)
WRITE_RECORD = False  # write .tree-record.json (commit, changes, file hashes) for a copy of this tree without .git

_REPO = Path(__file__).resolve().parents[1]
_TREE_RECORD = ".tree-record.json"  # at the repo root; .gitignore lists it
_SHOWN_PATHS = 5  # changed or differing paths named in a line before "and N more"


def _git(root: Path, *args: str) -> str | None:
    """git's output in `root`, or None where git is missing or fails (not a checkout)."""
    try:
        done = subprocess.run(["git", "-C", str(root), *args], capture_output=True, text=True)
    except FileNotFoundError:
        return None
    return done.stdout if done.returncode == 0 else None


def git_state(root: Path = _REPO) -> tuple[str, list[str]] | None:
    """(short commit, `git status --porcelain` lines) of the checkout whose top is `root`; None where root is not
    the top of one (a copy without .git inside some other repository is not that repository's tree)."""
    top = _git(root, "rev-parse", "--show-toplevel")
    if top is None or Path(top.strip()).resolve() != root.resolve():
        return None
    commit = (_git(root, "rev-parse", "--short", "HEAD") or "").strip() or "no commit yet"
    status = _git(root, "status", "--porcelain") or ""
    return commit, [line.strip() for line in status.splitlines() if line and line[3:] != _TREE_RECORD]


def _some(items: list[str]) -> str:
    shown = ", ".join(items[:_SHOWN_PATHS])
    return shown + (f" and {len(items) - _SHOWN_PATHS} more" if len(items) > _SHOWN_PATHS else "")


def describe(commit: str, changes: list[str]) -> str:
    """'abc1234, tree clean' or 'abc1234 with uncommitted changes in N paths (M a.py, ?? b.py)'."""
    if not changes:
        return f"{commit}, tree clean"
    return f"{commit} with uncommitted changes in {len(changes)} path(s) ({_some(changes)})"


def travelling_files(root: Path = _REPO) -> list[str]:
    """What a copy of the working tree takes: tracked files and untracked ones git does not ignore (those present)."""
    listed = (_git(root, "ls-files", "-z", "--cached", "--others", "--exclude-standard") or "").split("\0")
    return sorted({name for name in listed if name and (root / name).is_file()})


def file_hash(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()[:16]


def write_record(root: Path = _REPO) -> Path:
    """Writes .tree-record.json for the checkout at `root`: its commit, changes, time, each travelling file's hash."""
    state = git_state(root)
    if state is None:
        raise SystemExit(f"error: {root} is not the top of a git checkout: no commit to record in {_TREE_RECORD}")
    commit, changes = state
    record = {"commit": commit, "changes": changes,
              "written": datetime.now(timezone.utc).isoformat(timespec="seconds"),
              "files": {name: file_hash(root / name) for name in travelling_files(root) if name != _TREE_RECORD}}
    path = root / _TREE_RECORD
    path.write_text(json.dumps(record, indent=1, sort_keys=True) + "\n", encoding="utf-8")
    return path


def from_record(path: Path) -> tuple[str, bool]:
    """The commit line's text from a .tree-record.json, and whether the files beside it all match it."""
    try:
        record = json.loads(path.read_text(encoding="utf-8"))
        commit, changes, written, files = record["commit"], record["changes"], record["written"], record["files"]
    except (ValueError, KeyError, TypeError) as err:
        return f"unknown (no .git; {path.name} is not a record written by log_header.py: {err})", False
    differ = [name for name, digest in files.items()
              if not (path.parent / name).is_file() or file_hash(path.parent / name) != digest]
    where = f"from {path.name} written {written}"
    if not differ:
        return f"{describe(commit, changes)} ({where}; the {len(files)} files it lists match this tree)", True
    return (f"{describe(commit, changes)} ({where}; but {len(differ)} of the {len(files)} files it lists differ "
            f"here: {_some(differ)}: the record is older than this tree)"), False


def commit_line(root: Path = _REPO) -> str:
    """The header's commit line. A record whose files all match this tree names the commit, also over a .git: the GPU
    machine's copy of the tree can sit on a .git of another commit (seen: the session's first commit, with every
    change since as uncommitted), which would name the wrong one. Else git's own state, else the record as it is."""
    record = root / _TREE_RECORD
    text, matches = from_record(record) if record.is_file() else ("", False)
    if matches:
        return "commit: " + text
    state = git_state(root)
    if state is not None:
        return "commit: " + describe(*state)
    if text:
        return "commit: " + text
    why = "git is not installed" if shutil.which("git") is None and (root / ".git").exists() else "no .git"
    return (f"commit: unknown ({why}, and no {_TREE_RECORD}: write it with `python benchmarks/log_header.py "
            "--WRITE_RECORD=1` before copying the tree)")


def _machine_gpus() -> list[str]:
    """The GPUs nvidia-smi lists (the machine's, whatever CUDA_VISIBLE_DEVICES hides); [] without it."""
    if shutil.which("nvidia-smi") is None:
        return []
    try:
        done = subprocess.run(["nvidia-smi", "--query-gpu=name", "--format=csv,noheader"], capture_output=True,
                              text=True, timeout=30)
    except (OSError, subprocess.TimeoutExpired):
        return []
    return [line.strip() for line in done.stdout.splitlines() if line.strip()] if done.returncode == 0 else []


def _counted(names: list[str]) -> str:
    return ", ".join(f"{count} x {name}" if count > 1 else name for name, count in Counter(names).items())


def gpu_line() -> str:
    """'gpu: <the GPUs torch sees>' or 'gpu: no GPU (...)', naming the machine's GPUs when they are hidden."""
    import torch

    if torch.cuda.is_available():
        return "gpu: " + _counted([torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())])
    notes = []
    if os.environ.get("CUDA_VISIBLE_DEVICES") is not None:
        notes.append(f"CUDA_VISIBLE_DEVICES={os.environ['CUDA_VISIBLE_DEVICES']!r}")
    machine = _machine_gpus()
    if machine:
        notes.append(f"the machine has {_counted(machine)}")
    return "gpu: no GPU" + (f" ({'; '.join(notes)})" if notes else "")


def command_line(command: str | None = None) -> str:
    text = command or shlex.join(getattr(_sys, "orig_argv", [_sys.executable, *_sys.argv]))
    processes = int(os.environ.get("WORLD_SIZE", "1"))
    if processes > 1:  # a launcher's child sees its own argv only
        text += f" (rank {os.environ.get('RANK', '?')} of {processes} processes started by a launcher)"
    return "command: " + text


def header(command: str | None = None, copy_rate: float | None = None, device=None, root: Path = _REPO) -> str:
    """The lines a log begins with: command, commit, gpu, copy rate (when `copy_rate`, bytes/s, is given: the
    script measured it on `device`, decode_limit.measure_copy_rate; None: the current GPU) and versions."""
    import torch

    from tes_grpo.model.gpt_oss_shapes import stack_versions

    lines = [command_line(command), commit_line(root), gpu_line()]
    if copy_rate is not None:
        from benchmarks.decode_limit import copy_rate_line

        lines.append(copy_rate_line(copy_rate, torch.cuda.get_device_name(device)))
    lines.append("versions: " + stack_versions(device=False))
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    s = resolve(globals(), argv)
    if s.WRITE_RECORD:
        path = write_record()
        print(f"wrote {path}: {commit_line()}; name {_TREE_RECORD} in the GPU run's carry")
        return 0
    print(header(s.COMMAND or None), flush=True)
    return 0


if __name__ == "__main__":
    _sys.exit(main())
