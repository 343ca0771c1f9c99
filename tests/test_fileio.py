"""fileio.py: reading user CSVs (UTF-8, byte-order mark, duplicate names, folders), all-or-nothing atomic writes
through symlinks, and folders written through a temporary folder with ordinary modes."""

import codecs
import errno
import os
import re
import stat
from pathlib import Path

import pytest

from tes_grpo.run import fileio
from tes_grpo.run.fileio import (
    InputError,
    OutputError,
    atomic_output,
    atomic_write_text,
    csv_files,
    give_default_modes,
    read_csv_header,
    read_csv_table,
    read_csv_text,
    replace_folder,
    temporary_folder,
    text_writer,
    write_files_atomic,
)


def test_replace_folder_puts_the_new_one_in_place_and_the_old_one_back_on_failure(tmp_path, monkeypatch):
    target = tmp_path / "export"
    first = temporary_folder(target)
    (first / "a.txt").write_text("first")
    replace_folder(first, target)  # no folder there yet
    assert (target / "a.txt").read_text() == "first" and not first.exists()
    second = temporary_folder(target)
    (second / "b.txt").write_text("second")
    replace_folder(second, target)  # over the old one, which is then deleted
    assert sorted(p.name for p in tmp_path.iterdir()) == ["export"] and (target / "b.txt").read_text() == "second"
    third = temporary_folder(target)
    real_replace = os.replace

    def fail_onto_target(source, destination):
        if Path(source) == third:
            raise OSError(errno.EXDEV, "cross-device link")
        return real_replace(source, destination)

    monkeypatch.setattr(fileio.os, "replace", fail_onto_target)
    with pytest.raises(OSError, match="cross-device"):
        replace_folder(third, target)
    assert (target / "b.txt").read_text() == "second"  # the old folder is back under its name
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted(["export", third.name])


def test_temporary_folder_then_default_modes(tmp_path):
    old = os.umask(0o022)
    try:
        target = tmp_path / "out" / "model"
        temp = temporary_folder(target)
        assert temp.parent == target.parent and temp.name.startswith(".model.tmp-")
        assert stat.S_IMODE(temp.stat().st_mode) == 0o700  # mkdtemp's mode, until the folder is complete
        (temp / "sub").mkdir(mode=0o700)
        weights = temp / "sub" / "weights.bin"
        weights.write_bytes(b"x")
        os.chmod(weights, 0o600)  # as files written through mkstemp are
        give_default_modes(temp)
        modes = {p.relative_to(temp).as_posix(): stat.S_IMODE(p.stat().st_mode) for p in [temp, *temp.rglob("*")]}
        assert modes == {".": 0o755, "sub": 0o755, "sub/weights.bin": 0o644}
    finally:
        os.umask(old)


# ---- reading --------------------------------------------------------------------------------------------------
# (file bytes, expected text or the words of the InputError)
READ_CASES = [
    (b"a,b\n1,2\n", "a,b\n1,2\n"),  # plain UTF-8
    (codecs.BOM_UTF8 + b"a,b\n1,2\n", "a,b\n1,2\n"),  # Excel's "CSV UTF-8": the mark is dropped
    ("a,b\n\u00e9,\u2713\n".encode(), "a,b\n\u00e9,\u2713\n"),  # non-ASCII
    (b"a,b\n1,2\n3,\xff\n", ["row 2", "not valid UTF-8 at byte 10 (0xff)"]),  # a Latin-1 byte in row 2
    (b"a,\xe9\n1,2\n", ["not valid UTF-8 at byte 2 (0xe9) in the header"]),
    (codecs.BOM_UTF8 + b"a\n\xff\n", ["row 1", "byte 5 (0xff)"]),  # the offset counts the mark
    (b'a,b\n1,"x\ny\xff"\n', ["row 1", "byte 10"]),  # inside a quoted multi-line cell: the record's row
    (b"a\n\n\n2\n\xff", ["row 2"]),  # blank lines are no rows (pandas skips them)
]


@pytest.mark.parametrize("data, expected", READ_CASES)
def test_read_csv_text(tmp_path, data, expected):
    path = tmp_path / "x.csv"
    path.write_bytes(data)
    if isinstance(expected, str):
        assert read_csv_text(path) == expected
        return
    with pytest.raises(InputError) as info:
        read_csv_text(path)
    assert str(info.value).startswith(str(path))
    for word in expected:
        assert word in str(info.value)


# (header line, duplicate column or None)
HEADER_CASES = [
    ("a,b,c", None),
    ("a,b,a", "a"),  # pandas would call the second one a.1
    ("a,a.1,a", "a"),  # even when a.1 exists
    ('"x,y",b,"x,y"', "x,y"),  # quoted names
    ("a,,", ""),  # two empty names
]


@pytest.mark.parametrize("header, duplicate", HEADER_CASES)
def test_duplicate_column_names_are_refused(tmp_path, header, duplicate):
    path = tmp_path / "x.csv"
    path.write_text(header + "\n" + ",".join(["1"] * 3) + "\n")
    if duplicate is None:
        assert list(read_csv_table(path).columns) == read_csv_header(path)
        return
    for read in (read_csv_table, read_csv_header):
        with pytest.raises(InputError, match=f"column {re.escape(repr(duplicate))}: duplicate column name"):
            read(path)


def test_csv_files(tmp_path):
    (tmp_path / "d" / "sub").mkdir(parents=True)
    for name in ("d/b.csv", "d/a.csv", "d/sub/c.csv", "d/notes.txt", "lone.csv"):
        (tmp_path / name).write_text("x\n")
    (tmp_path / "d" / "folder.csv").mkdir()  # a folder with a CSV name: searched, not read
    (tmp_path / "d" / "folder.csv" / "e.csv").write_text("x\n")
    os.symlink("a.csv", tmp_path / "d" / "link.csv")  # the same file again: taken once
    files, skipped = csv_files([tmp_path / "d", tmp_path / "lone.csv", tmp_path / "d" / "a.csv"],
                               wanted=lambda p: p.name != "b.csv")
    names = [str(p.relative_to(tmp_path)) for p in files]
    assert names == ["d/a.csv", "d/folder.csv/e.csv", "d/sub/c.csv", "lone.csv"]
    assert skipped == [tmp_path / "d" / "b.csv"]
    files, _ = csv_files([tmp_path / "d" / "b.csv"], wanted=lambda p: False)  # a file given by name is always taken
    assert files == [tmp_path / "d" / "b.csv"]


# (how the bad path is made, words of the error)
BAD_PATH_CASES = [
    (lambda root: root / "missing.csv", "no such file or folder"),
    (lambda root: (os.symlink("gone.csv", root / "z.csv"), root / "z.csv")[1], "broken link (its target gone.csv"),
    (lambda root: (os.symlink("gone.csv", root / "z.csv"), root)[1], "broken link"),  # found in a folder
    (lambda root: (os.mkfifo(root / "p.csv"), root / "p.csv")[1], "not a regular file or folder"),
]


@pytest.mark.parametrize("make, words", BAD_PATH_CASES)
def test_csv_files_errors_name_the_path(tmp_path, make, words):
    path = make(tmp_path)
    with pytest.raises(InputError, match=re.escape(words)) as info:
        csv_files([path])
    assert str(info.value).startswith(str(tmp_path))


# ---- writing ---------------------------------------------------------------------------------------------------
def tree(root: Path) -> dict:
    return {str(p.relative_to(root)): (os.readlink(p) if p.is_symlink() else p.read_bytes() if p.is_file() else None)
            for p in sorted(root.rglob("*"))}


def failing(real, fail_on: int, error=errno.ENOSPC):
    calls = []

    def wrapper(*args):
        calls.append(args)
        if len(calls) == fail_on:
            raise OSError(error, os.strerror(error))
        return real(*args)
    return wrapper


# (helper that fails, on which call, the error's words)
ROLLBACK_CASES = [
    ("_rename", 1, "No space left on device; nothing was written"),  # the first rename
    ("_rename", 2, "No space left on device; nothing was changed"),  # the first output is restored
    ("_rename", 3, "No space left on device; nothing was changed"),  # two restored (one was new: removed)
    ("_temporary_beside", 2, "No space left on device; nothing was written"),  # while writing the temporaries
]


@pytest.mark.parametrize("helper, call, words", ROLLBACK_CASES)
def test_write_files_atomic_is_all_or_nothing(tmp_path, monkeypatch, helper, call, words):
    (tmp_path / "old1.txt").write_text("old one")
    (tmp_path / "old2.txt").write_text("old two")
    before = tree(tmp_path)
    monkeypatch.setattr(fileio, helper, failing(getattr(fileio, helper), call))
    outputs = [(tmp_path / "old1.txt", text_writer("new one")), (tmp_path / "new" / "n.txt", text_writer("new")),
               (tmp_path / "old2.txt", text_writer("new two"))]
    with pytest.raises(OutputError, match=re.escape(words)):
        write_files_atomic(outputs)
    assert tree(tmp_path) == before  # earlier files restored, new file and its new folder removed, no temporaries


def test_write_files_atomic_writes_all_through_links_with_ordinary_modes(tmp_path):
    old = os.umask(0o022)
    try:
        (tmp_path / "real.txt").write_text("old")
        os.chmod(tmp_path / "real.txt", 0o640)
        os.symlink("real.txt", tmp_path / "link.txt")
        written = write_files_atomic([(tmp_path / "link.txt", text_writer("via link")),
                                      (tmp_path / "a" / "b.txt", text_writer("new"))])
    finally:
        os.umask(old)
    assert written == [tmp_path / "link.txt", tmp_path / "a" / "b.txt"]
    assert os.readlink(tmp_path / "link.txt") == "real.txt" and (tmp_path / "real.txt").read_text() == "via link"
    assert stat.S_IMODE((tmp_path / "real.txt").stat().st_mode) == 0o640  # the old file's mode is kept
    assert stat.S_IMODE((tmp_path / "a" / "b.txt").stat().st_mode) == 0o644  # a new one gets open()'s
    assert sorted(p.name for p in tmp_path.rglob("*")) == ["a", "b.txt", "link.txt", "real.txt"]


def test_write_files_atomic_refuses_two_outputs_to_one_file(tmp_path):
    (tmp_path / "real.txt").write_text("old")
    os.symlink("real.txt", tmp_path / "link.txt")
    with pytest.raises(InputError, match="two outputs of this command would be the same file"):
        write_files_atomic([(tmp_path / "link.txt", text_writer("a")), (tmp_path / "real.txt", text_writer("b"))])
    assert (tmp_path / "real.txt").read_text() == "old"


# (where the output goes, words of the error)
REAL_FAILURE_CASES = [
    ("file.txt/out.csv", "file.txt is a file, not a folder"),  # a folder path that is a file
    ("file.txt/deeper/out.csv", "is a file, not a folder"),
    ("dir", "Is a directory"),  # the target is a folder
]


def write_with_atomic_output(path: Path) -> None:
    with atomic_output(path) as tmp:
        tmp.write_text("x")


@pytest.mark.parametrize("relative, words", REAL_FAILURE_CASES)
@pytest.mark.parametrize("write", [lambda path: atomic_write_text(path, "x"), write_with_atomic_output])
def test_writes_that_fail_for_real_raise_output_errors(tmp_path, relative, words, write):
    (tmp_path / "file.txt").write_text("mine")
    (tmp_path / "dir").mkdir()
    before = tree(tmp_path)
    with pytest.raises(OutputError, match=re.escape(words)) as info:
        write(tmp_path / relative)
    assert str(info.value).startswith(str(tmp_path / relative))
    assert tree(tmp_path) == before


def test_atomic_output_writes_through_a_link_and_cleans_up_on_error(tmp_path):
    (tmp_path / "real.png").write_bytes(b"old")
    os.symlink("real.png", tmp_path / "link.png")
    with atomic_output(tmp_path / "link.png", suffix=".png") as tmp:
        tmp.write_bytes(b"new")
    assert (tmp_path / "link.png").is_symlink() and (tmp_path / "real.png").read_bytes() == b"new"
    with pytest.raises(OutputError, match="cannot write: No space left"):
        with atomic_output(tmp_path / "link.png") as tmp:
            tmp.write_bytes(b"half")
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
    assert (tmp_path / "real.png").read_bytes() == b"new"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["link.png", "real.png"]


def test_a_failed_rollback_keeps_the_earlier_file_and_says_where(tmp_path, monkeypatch):
    (tmp_path / "a.txt").write_text("old a")
    (tmp_path / "b.txt").write_text("old b")
    real = fileio._rename
    calls = []

    def rename(source, target):  # the second output's rename fails, and so does putting a.txt's backup back
        calls.append(source)
        if len(calls) >= 2:
            raise OSError(errno.EIO, os.strerror(errno.EIO))
        real(source, target)

    monkeypatch.setattr(fileio, "_rename", rename)
    with pytest.raises(OutputError, match="could not restore") as info:
        write_files_atomic([(tmp_path / "a.txt", text_writer("new a")), (tmp_path / "b.txt", text_writer("new b"))])
    backup = Path(str(info.value).split("the earlier file is ")[1].rstrip(")"))
    assert backup.read_text() == "old a" and (tmp_path / "b.txt").read_text() == "old b"


# ---- one CSV cell as a number: (text, low, high, expected value or the error's end) ------------------------
WHOLE_CASES = [
    ("2", 0, 3, 2),  # as written by pandas and the data scripts
    (" 3 ", 0, 3, 3),  # spaces around it
    (2, 0, 3, 2),  # already a number (a frame built in code)
    ("-1", None, None, -1),  # no range
    ("4", 0, 3, "value '4': action must be in 0..3"),  # out of range
    ("-1", 0, None, "value '-1': action must be in 0.."),  # below the floor
    ("1.0", 0, 3, "value '1.0': action is not a whole number"),  # a float's spelling, refused
    ("1e0", 0, 3, "value '1e0': action is not a whole number"),  # so is an exponent
    (1.0, 0, 3, "value 1.0: action is not a whole number"),  # a float value too
    (True, 0, 3, "value True: action is not a whole number"),  # bool is no count
    ("", 0, 3, "column 'c': missing action"),  # empty cell
    ("two", 0, 3, "value 'two': action is not a whole number"),  # text
    ("--1", 0, 3, "value '--1': action is not a whole number"),  # two signs
    ("\u00b2", 0, 3, "value '\u00b2': action is not a whole number"),  # a superscript two (str.isdigit says yes)
    ("\u0663", 0, 3, "value '\u0663': action is not a whole number"),  # an Arabic-Indic three: ASCII digits only
    ("+1", 0, 3, 1),  # a plus sign is a sign
]


@pytest.mark.parametrize("text, low, high, expected", WHOLE_CASES)
def test_parse_whole(text, low, high, expected):
    if isinstance(expected, int):
        assert fileio.parse_whole("f.csv", 5, "c", text, low, high, what="action") == expected
    else:
        with pytest.raises(fileio.InputError) as err:
            fileio.parse_whole("f.csv", 5, "c", text, low, high, what="action")
        assert str(err.value).startswith("f.csv, row 5, column 'c'") and str(err.value).endswith(expected)


FINITE_CASES = [
    ("0.25", "", 0.25),  # a number
    ("1e-3", "", 0.001),  # exponents are fine for floats
    ("nan", "", "value 'nan': reward is not finite"),  # NaN
    ("-inf", "", "value '-inf': reward is not finite"),  # infinite
    ("x", " (hint)", "value 'x': reward is not a number (hint)"),  # the hint ends the message
    ("", " (hint)", "column 'c': missing reward (hint)"),  # empty, with the hint
    (None, "", "column 'c': missing reward"),  # no cell at all
]


@pytest.mark.parametrize("text, hint, expected", FINITE_CASES)
def test_parse_finite(text, hint, expected):
    if isinstance(expected, float):
        assert fileio.parse_finite("f.csv", 5, "c", text, what="reward", hint=hint) == expected
    else:
        with pytest.raises(fileio.InputError) as err:
            fileio.parse_finite("f.csv", 5, "c", text, what="reward", hint=hint)
        assert str(err.value).startswith("f.csv, row 5, column 'c'") and str(err.value).endswith(expected)
