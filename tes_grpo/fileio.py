"""Small file helpers shared by the scripts: atomic writes and input errors that name their place.

Every output is written to a temporary file in the destination folder and renamed over the target,
so a failure (bad row, full disk, Ctrl-C) never leaves a half-written or clobbered user file.
"""

from __future__ import annotations

import contextlib
import math
import os
import tempfile
from pathlib import Path


class InputError(ValueError):
    """Bad user input; the message names the file and, where known, the row, column and value."""

    def __init__(self, path, message: str, row: int | None = None, column: str | None = None, value=None):
        where = str(path)
        if row is not None:
            where += f", row {row}"
        if column is not None:
            where += f", column {column!r}"
        if value is not None:
            where += f", value {value!r}"
        super().__init__(f"{where}: {message}")
        self.path, self.row, self.column, self.value = path, row, column, value


def parse_finite(path, row: int, column: str, text, what: str = "") -> float:
    """A CSV cell as a finite float, or an InputError naming file, row, column and value ("what" prefixes it)."""
    prefix = f"{what} " if what else ""
    if text is None or (isinstance(text, str) and text.strip() == ""):
        raise InputError(path, f"missing {what or 'value'}", row=row, column=column)
    try:
        value = float(text)
    except ValueError:
        raise InputError(path, f"{prefix}is not a number" if what else "not a number", row=row, column=column,
                         value=text) from None
    if not math.isfinite(value):
        raise InputError(path, f"{prefix}is not finite" if what else "not finite", row=row, column=column, value=text)
    return value


@contextlib.contextmanager
def atomic_output(path: str | os.PathLike, suffix: str | None = None):
    """Yields a temporary path next to `path`; renames it onto `path` only if the block succeeds."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=suffix or ".tmp", dir=path.parent)
    os.close(fd)
    try:
        yield Path(tmp)
        # mkstemp makes the file 0600; give the output the mode a plain open() would (or the old file's).
        os.chmod(tmp, path.stat().st_mode & 0o777 if path.exists() else 0o666 & ~_umask())
        os.replace(tmp, path)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)


def temporary_folder(beside: str | os.PathLike) -> Path:
    """A new empty folder next to `beside`, for writing a whole output folder that is renamed onto it when complete."""
    beside = Path(beside)
    beside.parent.mkdir(parents=True, exist_ok=True)
    return Path(tempfile.mkdtemp(prefix=f".{beside.name}.tmp-", dir=beside.parent))


def give_default_modes(folder: str | os.PathLike) -> None:
    """Gives a folder written through temporary files the modes plain mkdir()/open() would have (not 0700/0600)."""
    folder = Path(folder)
    os.chmod(folder, 0o777 & ~_umask())
    for path in folder.rglob("*"):
        os.chmod(path, (0o777 if path.is_dir() else 0o666) & ~_umask())


def _umask() -> int:
    mask = os.umask(0)
    os.umask(mask)
    return mask


def atomic_write_text(path: str | os.PathLike, text: str) -> Path:
    with atomic_output(path) as tmp:
        tmp.write_text(text, encoding="utf-8")
    return Path(path)


def write_csv_atomic(frame, path: str | os.PathLike) -> Path:
    """Writes a pandas DataFrame as CSV (no index, '\\n' line ends) through a temporary file."""
    with atomic_output(path, suffix=".csv") as tmp:
        frame.to_csv(tmp, index=False, lineterminator="\n")
    return Path(path)
