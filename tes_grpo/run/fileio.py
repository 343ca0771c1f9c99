"""Small file helpers shared by the scripts: reading user CSVs, atomic writes, and errors that name their place.

Reading: `csv_files` expands folders into their CSV files; `read_csv_text` / `read_csv_table` read one as UTF-8 (a
byte-order mark, as Excel's "CSV UTF-8" writes, is accepted) and refuse invalid UTF-8 and duplicate column names
with an InputError naming the file, row and byte or column.

Writing: every output is written to a temporary file in the destination folder and renamed over the target, so a
failure (bad row, full disk, Ctrl-C) never leaves a half-written or clobbered user file. `write_files_atomic`
does that for all the outputs of one command at once: all are written first, then all renamed, and a failed
rename rolls back the renames already done. A path that is a symlink is resolved first, so the link's target is
replaced and the link stays a link. A failed write raises OutputError naming the file.
"""

from __future__ import annotations

import codecs
import contextlib
import csv
import io
import math
import os
import re
import secrets
import shutil
import sys
import tempfile
from collections.abc import Callable, Iterable, Sequence
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


class OutputError(InputError):
    """An output could not be written (read-only or full folder, a folder path that is a file); names the file.

    An InputError so that a script's one handler for user errors reports it as its one `error:` line.
    """


def parse_finite(path, row: int, column: str, text, what: str = "", hint: str = "") -> float:
    """A CSV cell as a finite float, or an InputError naming file, row, column and value ("what" prefixes it; "hint"
    ends the message, e.g. which script writes the column)."""
    prefix = f"{what} " if what else ""
    if text is None or (isinstance(text, str) and text.strip() == ""):
        raise InputError(path, f"missing {what or 'value'}{hint}", row=row, column=column)
    try:
        value = float(text)
    except (TypeError, ValueError):
        raise InputError(path, (f"{prefix}is not a number" if what else "not a number") + hint, row=row,
                         column=column, value=text) from None
    if not math.isfinite(value):
        raise InputError(path, (f"{prefix}is not finite" if what else "not finite") + hint, row=row, column=column,
                         value=text)
    return value


def parse_whole(path, row: int, column: str, text, low: int | None = None, high: int | None = None,
                what: str = "") -> int:
    """A CSV cell as a whole number written as one ("2", never "2.0" or "2e0"), within low..high where given, or an
    InputError naming file, row, column and value ("what" names it in the message)."""
    name = what or "value"
    if text is None or (isinstance(text, str) and text.strip() == ""):
        raise InputError(path, f"missing {name}", row=row, column=column)
    digits = text.strip() if isinstance(text, str) else None
    if isinstance(text, bool) or not (isinstance(text, int) or hasattr(text, "__index__")
                                      or digits is not None and re.fullmatch(r"[+-]?[0-9]+", digits)):
        raise InputError(path, f"{name} is not a whole number", row=row, column=column, value=text)
    number = int(digits) if digits is not None else int(text)
    if (low is not None and number < low) or (high is not None and number > high):
        span = f"{'' if low is None else low}..{'' if high is None else high}"
        raise InputError(path, f"{name} must be in {span}", row=row, column=column, value=text)
    return number


# ---------------------------------------------------------------------------------------------------------------
# Reading


def _reason(err: OSError) -> str:
    return err.strerror or str(err)


def csv_files(paths: Iterable, wanted: Callable[[Path], bool] | None = None,
              pattern: str = "*.csv") -> tuple[list[Path], list[Path]]:
    """(files, skipped) for command-line paths: a file is taken as given; a folder gives the files below it
    (recursively, sorted) whose name matches `pattern`, those for which `wanted(path)` is false going to `skipped`.

    A folder whose name matches (a folder named `x.csv`) is searched like any folder, not read as a file.
    A path given twice (or a link to a file already found) is taken once. InputError for a path that does not
    exist, a broken link (given or found in a folder) and anything that is neither a file nor a folder.
    """
    files, skipped, seen = [], [], set()

    def take(path: Path, from_folder: bool) -> None:
        real = os.path.realpath(path)
        if real in seen:
            return
        seen.add(real)
        (files if not from_folder or wanted is None or wanted(path) else skipped).append(path)

    for raw in paths:
        path = Path(raw)
        if path.is_dir():
            for found in sorted(path.rglob(pattern)):
                if not found.is_dir():
                    take(_existing_file(found), from_folder=True)
        else:
            take(_existing_file(path), from_folder=False)
    return files, skipped


def _existing_file(path: Path) -> Path:
    if path.is_file():
        return path
    if path.is_symlink() and not path.exists():
        raise InputError(path, f"broken link (its target {os.readlink(path)} does not exist)")
    if path.exists():
        raise InputError(path, "not a regular file or folder")
    raise InputError(path, "no such file or folder")


def read_csv_text(path: str | os.PathLike) -> str:
    """The file's text as UTF-8 without a leading byte-order mark; InputError naming the file on a read error,
    and the row (1 = first data row) and byte offset of the first byte that is not UTF-8."""
    path = Path(path)
    if path.is_dir():
        raise InputError(path, "is a folder, not a CSV file")
    if path.is_symlink() and not path.exists():
        raise InputError(path, f"broken link (its target {os.readlink(path)} does not exist)")
    try:
        data = path.read_bytes()
    except OSError as err:
        raise InputError(path, f"cannot read: {_reason(err)}") from None
    skip = len(codecs.BOM_UTF8) if data.startswith(codecs.BOM_UTF8) else 0
    try:
        return data[skip:].decode("utf-8")
    except UnicodeDecodeError as err:
        start = skip + err.start
        row = _row_of_offset(data[skip:start].decode("utf-8"))
        where = " in the header" if row == 0 else ""
        message = f"not valid UTF-8 at byte {start} (0x{data[start]:02x}){where}; save the file as UTF-8"
        raise InputError(path, message, row=row or None) from None


def _row_of_offset(prefix: str) -> int | None:
    """The CSV data row (1 = first after the header, 0 = the header) in which the text after `prefix` begins;
    None if the text before it is not CSV the csv module can read."""
    # a sentinel after the prefix lands in the record being read at that point, quoted newlines included
    try:
        records = list(csv.reader(io.StringIO(prefix + "x")))
    except csv.Error:
        return None
    return sum(1 for record in records[:-1] if record)


def csv_header(text: str, path="<csv>") -> list[str]:
    """The first non-empty record of CSV text (pandas skips blank lines before the header too)."""
    try:
        for record in csv.reader(io.StringIO(text)):
            if record:
                return record
    except csv.Error as err:
        raise InputError(path, f"cannot read the header as CSV: {err}") from None
    return []


def check_unique_columns(path, header: Sequence[str]) -> None:
    """InputError naming the first column name that appears twice (pandas would silently rename it `name.1`)."""
    seen = set()
    for name in header:
        if name in seen:
            raise InputError(path, "duplicate column name (each column must appear once)", column=name)
        seen.add(name)


def read_csv_header(path: str | os.PathLike) -> list[str]:
    """The header of a CSV file, read and checked as `read_csv_table` would (UTF-8, unique names)."""
    header = csv_header(read_csv_text(path), path)
    check_unique_columns(path, header)
    return header


def read_csv_rows(path: str | os.PathLike) -> list[list[str]]:
    """The CSV's records as lists of strings, header first, header cells stripped; InputError naming the file for an
    unreadable file, invalid UTF-8, a duplicate column name, or text the csv module cannot parse."""
    text = read_csv_text(path)
    try:
        table = [record for record in csv.reader(io.StringIO(text))]
    except csv.Error as err:
        raise InputError(path, f"cannot read as CSV: {err}") from None
    if table:
        table[0] = [cell.strip() for cell in table[0]]
        check_unique_columns(path, table[0])
    return table


def read_csv_table(path: str | os.PathLike):
    """The CSV as a pandas DataFrame of strings (nothing reformatted; empty cells stay empty strings).

    InputError naming the file for an unreadable file, invalid UTF-8 (with row and byte), a duplicate column
    name, or text pandas cannot parse.
    """
    import pandas as pd  # here, not at the top: every script imports fileio, most never read a frame

    text = read_csv_text(path)
    check_unique_columns(path, csv_header(text, path))
    try:
        return pd.read_csv(io.StringIO(text), dtype=str, keep_default_na=False, na_filter=False)
    except (pd.errors.ParserError, pd.errors.EmptyDataError) as err:
        raise InputError(path, f"cannot read as CSV: {err}") from None


# ---------------------------------------------------------------------------------------------------------------
# Writing


def _rename(source: Path, target: Path) -> None:
    """The one place an output is renamed into place (tests make it fail like a full or read-only disk)."""
    os.replace(source, target)


def _temporary_beside(target: Path, suffix: str) -> Path:
    """A new empty temporary file in target's folder (tests make it fail like a full or read-only disk)."""
    fd, tmp = tempfile.mkstemp(prefix=f".{target.name}.", suffix=suffix, dir=target.parent)
    os.close(fd)
    return Path(tmp)


def _real_target(path: str | os.PathLike) -> Path:
    # a symlinked output is written through to its target: replacing the link itself would turn it into a file
    # and leave its target old
    return Path(os.path.realpath(path))


def _make_folders(folder: Path) -> list[Path]:
    """Creates `folder` and its missing parents; returns those created (outermost first) for a rollback."""
    missing = []
    probe = folder
    while not probe.exists() and probe != probe.parent:
        missing.append(probe)
        probe = probe.parent
    if probe.exists() and not probe.is_dir():
        raise NotADirectoryError(20, f"{probe} is a file, not a folder")
    for created in reversed(missing):
        created.mkdir()
    return list(reversed(missing))


def _remove_folders(created: list[Path]) -> None:
    for folder in reversed(created):
        with contextlib.suppress(OSError):  # not empty (someone else wrote there meanwhile): keep it
            folder.rmdir()


def _new_file_mode(target: Path) -> int:
    # mkstemp makes the file 0600; give the output the mode a plain open() would (or the old file's)
    return target.stat().st_mode & 0o777 if target.exists() else 0o666 & ~_umask()


def _backup(target: Path) -> Path:
    """A second name for the current target, to restore it if a later rename of the same command fails."""
    backup = target.with_name(f".{target.name}.{secrets.token_hex(6)}.bak")
    try:
        os.link(target, backup)  # no copy, no space needed
    except OSError:
        # some filesystems have no hard links; a copy keeps the same bytes and mode
        shutil.copy2(target, backup)
    return backup


def write_files_atomic(outputs: Sequence[tuple[str | os.PathLike, Callable[[Path], None]]],
                       suffix: str = ".tmp") -> list[Path]:
    """Writes several outputs all or nothing; `outputs` pairs each target with a function writing a given path.

    Every output is first written to a temporary file beside its target; only when all are written are they
    renamed onto their targets. If a rename fails, the renames already done are undone (earlier files restored,
    new ones removed) and folders created for the outputs removed. Any OSError becomes an OutputError naming the
    output; the writers' own errors (e.g. InputError) pass through after the same cleanup. Returns the paths as
    given.
    """
    targets = [_real_target(path) for path, _ in outputs]
    if len(set(targets)) != len(targets):
        duplicate = next(t for t in targets if targets.count(t) > 1)
        raise InputError(duplicate, "two outputs of this command would be the same file")
    staged: list[tuple[Path, Path, Path, Path | None]] = []  # (as given, real target, temporary, backup)
    created: list[Path] = []
    renamed: list[tuple[Path, Path, Path, Path | None]] = []
    kept: set[Path] = set()  # backups a failed rollback could not put back: the user's only copy, never deleted
    finished = False
    try:
        for (path, write), target in zip(outputs, targets, strict=True):
            try:
                created += _make_folders(target.parent)
                tmp = _temporary_beside(target, suffix)
                staged.append((Path(path), target, tmp, None))
                write(tmp)
                os.chmod(tmp, _new_file_mode(target))
                if target.exists():
                    staged[-1] = (Path(path), target, tmp, _backup(target))
            except OSError as err:
                raise OutputError(path, f"cannot write: {_reason(err)}; nothing was written") from None
        for entry in staged:
            path, target, tmp, _ = entry
            try:
                _rename(tmp, target)
            except OSError as err:
                undone = _roll_back(renamed, kept)
                raise OutputError(path, f"cannot write: {_reason(err)}; {undone}") from None
            except BaseException:  # Ctrl-C between two renames: back to the earlier files, not a mix
                _roll_back(renamed, kept)
                raise
            renamed.append(entry)
        finished = True
    finally:
        for _, _, tmp, backup in staged:
            for leftover in (tmp, backup):
                if leftover is not None and leftover not in kept and os.path.lexists(leftover):
                    try:
                        os.unlink(leftover)
                    except OSError as err:
                        print(f"warning: could not remove the temporary file {leftover}: {_reason(err)}",
                              file=sys.stderr)
        if not finished:
            _remove_folders(created)
    return [Path(path) for path, _ in outputs]


def _roll_back(renamed: list[tuple[Path, Path, Path, Path | None]], kept: set[Path]) -> str:
    """Undoes finished renames (newest first); returns what to tell the user. A backup that cannot be put back
    is added to `kept` (and named in the message) so that it is not deleted."""
    failed = []
    for path, target, _, backup in reversed(renamed):
        try:
            if backup is not None:
                _rename(backup, target)
            else:
                os.unlink(target)
        except OSError as err:
            if backup is not None:
                kept.add(backup)
            failed.append(f"{path} ({_reason(err)}{'; the earlier file is ' + str(backup) if backup else ''})")
    if failed:
        return "could not restore " + ", ".join(failed)
    return "nothing was changed" if renamed else "nothing was written"


def text_writer(text: str) -> Callable[[Path], None]:
    return lambda tmp: tmp.write_text(text, encoding="utf-8", newline="")


def csv_writer(frame) -> Callable[[Path], None]:
    """Writes a pandas DataFrame as CSV (no index, '\\n' line ends)."""
    return lambda tmp: frame.to_csv(tmp, index=False, lineterminator="\n")


@contextlib.contextmanager
def atomic_output(path: str | os.PathLike, suffix: str | None = None):
    """Yields a temporary path next to `path` (a symlink's target); renames it onto that only if the block succeeds.

    An OSError while preparing, writing or renaming becomes an OutputError naming `path`.
    """
    target = _real_target(path)
    tmp = None
    created: list[Path] = []
    finished = False
    try:
        try:
            created = _make_folders(target.parent)
            tmp = _temporary_beside(target, suffix or ".tmp")
        except OSError as err:
            raise OutputError(path, f"cannot write: {_reason(err)}") from None
        try:
            yield tmp
            os.chmod(tmp, _new_file_mode(target))
            _rename(tmp, target)
        except OSError as err:
            raise OutputError(path, f"cannot write: {_reason(err)}") from None
        finished = True
    finally:
        if tmp is not None and os.path.lexists(tmp):
            os.unlink(tmp)
        if not finished:
            _remove_folders(created)


def temporary_folder(beside: str | os.PathLike) -> Path:
    """A new empty folder next to `beside`, for writing a whole output folder that is renamed onto it when complete."""
    beside = Path(beside)
    beside.parent.mkdir(parents=True, exist_ok=True)
    return Path(tempfile.mkdtemp(prefix=f".{beside.name}.tmp-", dir=beside.parent))


def replace_folder(new: str | os.PathLike, target: str | os.PathLike) -> None:
    """Renames the complete folder `new` (from temporary_folder) onto `target`; an existing `target` is moved aside
    first, put back if the rename fails, and deleted after."""
    new, target = Path(new), Path(target)
    if not target.exists():
        os.replace(new, target)
        return
    old = target.with_name(f".{target.name}.old-{os.getpid()}")
    os.replace(target, old)
    try:
        os.replace(new, target)
    except OSError:
        os.replace(old, target)
        raise
    shutil.rmtree(old)


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
    return write_files_atomic([(path, text_writer(text))])[0]


def write_csv_atomic(frame, path: str | os.PathLike) -> Path:
    """Writes a pandas DataFrame as CSV (no index, '\\n' line ends) through a temporary file."""
    return write_files_atomic([(path, csv_writer(frame))], suffix=".csv")[0]
