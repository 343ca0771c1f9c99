"""Small file helpers shared by the scripts: atomic writes and input errors that name their place.

Every output is written to a temporary file in the destination folder and renamed over the target,
so a failure (bad row, full disk, Ctrl-C) never leaves a half-written or clobbered user file.
"""

from __future__ import annotations

import contextlib
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
