"""Bad input to the data scripts: one `error:` line naming file / row / column / setting and value, a
non-zero exit, and every input and earlier output byte-identical (no temporary file or new folder left either).

The scripts run in-process through main(argv) (fast; an uncaught exception fails the test, so a traceback cannot
pass), a few as subprocesses to see the real exit status and stderr. A full or read-only disk is simulated by
making fileio's rename or temporary-file helper raise OSError(ENOSPC) / OSError(EROFS): chmod cannot stop root.
"""

from __future__ import annotations

import codecs
import errno
import os
import subprocess
import sys
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import calculate_reward
import check_data
import convert_to_harmony
import make_q_dataset
import make_series
from tes_grpo.run import fileio
from tes_grpo.task.harmony import parse_action

REPO = Path(__file__).resolve().parents[1]
SERIES_TEXT = next(iter(make_series.generate_windows(n_windows=1, seed=5, start_date="2024-06-03").values()))
Q_HEADER = "timestep,prompt,q_action_0,q_action_1,q_action_2,q_action_3,series"
Q_ROWS = ['8,"system:\nhi, there\n\nuser:\nq?",-1.0,-1.1,-1.2,-1.3,w',
          '9,"system:\nhi\n\nuser:\nq2?",0.5,0.5,0.25,-2,w']
Q_TEXT = "\n".join([Q_HEADER, *Q_ROWS]) + "\n"
HARMONY_PROMPT = "<|start|>system<|message|>x<|end|><|start|>user<|message|>y<|end|><|start|>assistant"
HARMONY_HEADER = ("timestep,timestamp,prompt,optimal_action,q_action_0,q_action_1,q_action_2,q_action_3,"
                  "reward_action_0,reward_action_1,reward_action_2,reward_action_3")
HARMONY_ROW = f"8,2024-06-03T08:00:00,{HARMONY_PROMPT},1,-2.0,-1.0,-1.5,-3.0,0.1,0.6,0.3,0.0"
HARMONY_TEXT = f"{HARMONY_HEADER}\n{HARMONY_ROW}\n{HARMONY_ROW}\n"
SCRIPTS = {"calculate_reward": calculate_reward, "check_data": check_data, "convert_to_harmony": convert_to_harmony,
           "make_q_dataset": make_q_dataset, "make_series": make_series}


@pytest.fixture()
def work(tmp_path, monkeypatch) -> Path:
    """A workspace (also the working folder): series/a.csv, q/a_q_dataset.csv, h/a_harmony.csv, out/."""
    for name, text in (("series/a.csv", SERIES_TEXT), ("q/a_q_dataset.csv", Q_TEXT), ("h/a_harmony.csv", HARMONY_TEXT)):
        (tmp_path / name).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / name).write_text(text)
    (tmp_path / "out").mkdir()
    monkeypatch.chdir(tmp_path)
    return tmp_path


def snapshot(root: Path) -> dict:
    """Every path under root with its kind and bytes (links not followed): equal snapshots mean nothing changed."""
    state = {}
    for folder, dirs, files in os.walk(root):
        for name in dirs + files:
            path = Path(folder) / name
            key = str(path.relative_to(root))
            if path.is_symlink():
                state[key] = ("link", os.readlink(path))
            elif path.is_dir():
                state[key] = ("dir",)
            else:
                state[key] = ("file", path.read_bytes())
    return state


def run_main(script: str, argv: list[str], capsys) -> tuple[int, str, str]:
    try:
        code = SCRIPTS[script].main(argv)
    except SystemExit as exit_info:  # resolve() exits 2 on a value of the wrong type
        code = exit_info.code
    out, err = capsys.readouterr()
    return code, out, err


def one_error_line(err: str) -> str:
    lines = [line for line in err.splitlines() if line.startswith("error:")]
    assert len(lines) == 1, err
    assert "Traceback" not in err
    return lines[0]


def assert_refused(script, argv, code, words, work, capsys, where="err"):
    """Runs the script, checks its exit status, the message, and that nothing under the workspace changed."""
    before = snapshot(work)
    got, out, err = run_main(script, argv, capsys)
    assert got == code, (out, err)
    message = one_error_line(err) if where == "err" else out
    for word in words:
        assert word in message, message
    assert snapshot(work) == before


def write(path: Path, data: str | bytes) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(data if isinstance(data, bytes) else data.encode())
    return path


# ---- 1. an existing output is refused without --OVERWRITE, naming it: (script, argv, existing output) ----------
EXISTING_CASES = [
    ("calculate_reward", ["q/a_q_dataset.csv"], "runs/rewards/q/a_q_dataset_with_reward.csv"),  # OUT_DIR's copy
    ("calculate_reward", ["q"], "runs/rewards/q/a_q_dataset_with_reward.csv"),  # found through the folder
    ("calculate_reward", ["q", "--OUT_DIR="], "q/a_q_dataset_with_reward.csv"),  # beside the input
    ("make_q_dataset", ["series/a.csv", "--OUT_DIR=out"], "out/a_q_dataset.csv"),
    ("make_series", ["--OUT_DIR=out", "--N_WINDOWS=2"], "out/tes_2024-06-07.csv"),  # the second of two windows
    ("convert_to_harmony", ["q/a_q_dataset.csv"], "q/a_q_dataset_harmony.csv"),
]


@pytest.mark.parametrize("script, argv, existing", EXISTING_CASES)
def test_existing_output_is_refused(work, capsys, script, argv, existing):
    write(work / existing, "mine\n")
    assert_refused(script, argv, 1, [existing, "output exists", "--OVERWRITE"], work, capsys)


# ---- 2. duplicate column names are refused, naming the column: (script, argv, file, text, column) ------------------
DUPLICATE_CASES = [
    ("calculate_reward", ["q/a_q_dataset.csv"], "q/a_q_dataset.csv", Q_TEXT.replace(",series", ",q_action_0", 1),
     "q_action_0"),  # a Q dataset
    ("calculate_reward", ["q"], "q/a_q_dataset.csv", Q_TEXT.replace(",series", ",prompt", 1), "prompt"),  # in a folder
    ("make_q_dataset", ["series/a.csv", "--OUT_DIR=out"], "series/a.csv",
     SERIES_TEXT.replace("cooling_load_kw", "co2_kg_per_kwh", 1), "co2_kg_per_kwh"),  # a series
    ("convert_to_harmony", ["q/a_q_dataset.csv"], "q/a_q_dataset.csv", Q_TEXT.replace(",series", ",timestep", 1),
     "timestep"),  # before any tokenizer is loaded
]


@pytest.mark.parametrize("script, argv, name, text, column", DUPLICATE_CASES)
def test_duplicate_columns_are_refused(work, capsys, script, argv, name, text, column):
    write(work / name, text)
    assert_refused(script, argv, 1, [name, f"column '{column}'", "duplicate column"], work, capsys)


def test_check_data_lists_a_duplicate_column(work, capsys):
    write(work / "h/a_harmony.csv", HARMONY_TEXT.replace(",reward_action_3", ",reward_action_2", 1))
    assert_refused("check_data", ["h"], 1, ["h/a_harmony.csv", "column 'reward_action_2'", "duplicate column"],
                   work, capsys, where="out")


# ---- 3. --OVERWRITE onto a symlink writes through to its target; the link stays a link -----------------------------
# (script, argv, the link, its target, text the target must hold afterwards)
SYMLINK_CASES = [
    ("calculate_reward", ["q/link.csv", "--OVERWRITE"], "q/link.csv", "q/a_q_dataset.csv", "reward_action_0"),
    ("make_q_dataset", ["series/a.csv", "--OUT_DIR=out", "--OVERWRITE"], "out/a_q_dataset.csv",
     "elsewhere/kept.csv", "q_action_0"),
    ("make_series", ["--OUT_DIR=out", "--N_WINDOWS=1", "--OVERWRITE"], "out/tes_2024-06-03.csv",
     "elsewhere/kept.csv", "datetime,co2_kg_per_kwh"),
]


@pytest.mark.parametrize("script, argv, link, target, text", SYMLINK_CASES)
def test_overwrite_writes_through_a_symlink(work, capsys, script, argv, link, target, text):
    if not (work / target).exists():
        write(work / target, "old\n")
    os.symlink(os.path.relpath(work / target, (work / link).parent), work / link)
    code, out, err = run_main(script, argv, capsys)
    assert code == 0, err
    assert (work / link).is_symlink()
    assert text in (work / target).read_text()
    assert not [p for p in (work / link).parent.iterdir() if p.name.startswith(".")]  # no temporary left


# ---- 4. a full or read-only output folder: one error line, all or nothing ------------------------------------------
def fail_on_call(n: int, error: int):
    calls = {"count": 0}
    real = {"_rename": fileio._rename, "_temporary_beside": fileio._temporary_beside}

    def wrapper(name):
        def failing(*args):
            calls["count"] += 1
            if calls["count"] == n:
                raise OSError(error, os.strerror(error))
            return real[name](*args)
        return failing
    return wrapper


# (script, argv, earlier outputs written first with other bytes, helper that fails, on which call)
DISK_CASES = [
    ("make_series", ["--OUT_DIR=out", "--N_WINDOWS=3", "--OVERWRITE"], ["out/tes_2024-06-03.csv"], "_rename", 2),
    ("make_series", ["--OUT_DIR=out", "--N_WINDOWS=3"], [], "_rename", 3),  # new files only: the two are removed
    ("make_series", ["--OUT_DIR=out/new/deeper", "--N_WINDOWS=2"], [], "_temporary_beside", 2),  # folders removed
    ("make_q_dataset", ["series/a.csv", "series/b.csv", "--OUT_DIR=out", "--OVERWRITE"],
     ["out/a_q_dataset.csv", "out/b_q_dataset.csv"], "_rename", 2),
    ("make_q_dataset", ["series/a.csv", "series/b.csv", "--OUT_DIR=out"], [], "_temporary_beside", 1),
    ("calculate_reward", ["q", "--OVERWRITE"], [], "_rename", 2),  # the inputs themselves are restored
    ("calculate_reward", ["q"], [], "_rename", 2),
]


@pytest.mark.parametrize("script, argv, earlier, helper, call", DISK_CASES)
@pytest.mark.parametrize("error", [errno.ENOSPC, errno.EROFS])
def test_full_or_read_only_disk_changes_nothing(work, capsys, monkeypatch, script, argv, earlier, helper, call,
                                                error):
    write(work / "series/b.csv", SERIES_TEXT)
    write(work / "q/b_q_dataset.csv", Q_TEXT)
    for name in earlier:
        write(work / name, f"earlier {name}\n")
    monkeypatch.setattr(fileio, helper, fail_on_call(call, error)(helper))
    assert_refused(script, argv, 1, ["cannot write", os.strerror(error)], work, capsys)


def test_convert_to_harmony_full_disk_changes_nothing(work, capsys, monkeypatch, tokenizer):
    write(work / "q/b_q_dataset.csv", Q_TEXT)
    write(work / "q/b_q_dataset_harmony.csv", "earlier\n")
    monkeypatch.setattr(convert_to_harmony, "get_tokenizer", lambda source="": tokenizer)
    monkeypatch.setattr(fileio, "_rename", fail_on_call(2, errno.ENOSPC)("_rename"))
    assert_refused("convert_to_harmony", ["q", "--OVERWRITE"], 1, ["cannot write", "No space left"], work, capsys)


# a real failure, no monkeypatching: the output folder lies under a file: (script, argv)
UNDER_A_FILE_CASES = [
    ("make_series", ["--OUT_DIR=q/a_q_dataset.csv/sub", "--N_WINDOWS=1"]),
    ("make_q_dataset", ["series/a.csv", "--OUT_DIR=q/a_q_dataset.csv/sub"]),
]


@pytest.mark.parametrize("script, argv", UNDER_A_FILE_CASES)
def test_output_folder_under_a_file(work, capsys, script, argv):
    assert_refused(script, argv, 1, ["q/a_q_dataset.csv/sub/", "cannot write", "is a file, not a folder"], work, capsys)


# ---- 5. what used to be tracebacks: (script, argv, exit status, words of the error) --------------------------------
TRACEBACK_CASES = [
    ("calculate_reward", ["q"], 1, ["q/z.csv", "broken link"]),  # with the broken link made below
    ("convert_to_harmony", ["q"], 1, ["q/z.csv", "broken link"]),
    ("make_q_dataset", ["series/a.csv", "--OUT_DIR=q/a_q_dataset.csv"], 2, ["--OUT_DIR=", "is a file"]),
    ("make_series", ["--START_DATE=abc"], 2, ["--START_DATE='abc'", "not a real date"]),
    ("make_series", ["--START_DATE=2024-02-30"], 2, ["--START_DATE='2024-02-30'", "day is out of range"]),
    ("make_series", ["--START_DATE=9999-12-01"], 2, ["--START_DATE='9999-12-01'", "past the year 9999"]),
    ("convert_to_harmony", ["q", "--TOKENIZER=/no/such/folder"], 2, ["--TOKENIZER='/no/such/folder'",
                                                                    "folder does not exist"]),
    ("convert_to_harmony", ["q", "--TOKENIZER=q/a_q_dataset.csv"], 2, ["--TOKENIZER=", "is a file"]),
    ("convert_to_harmony", [], 2, ["no input", "name the legacy-prompt CSV files or folders"]),  # nothing named
]


@pytest.mark.parametrize("script, argv, code, words", TRACEBACK_CASES)
def test_former_tracebacks_are_error_lines(work, capsys, script, argv, code, words):
    os.symlink("gone.csv", work / "q/z.csv")
    assert_refused(script, argv, code, words, work, capsys)


# (script, argv, words of its output showing the CSV inside the folder was read)
FOLDER_NAMED_CSV_CASES = [
    ("calculate_reward", ["q"], "wrote runs/rewards/q/z.csv/inner_q_dataset_with_reward.csv"),
    ("convert_to_harmony", ["q"], "wrote q/z.csv/inner_q_dataset_harmony.csv"),
    ("check_data", ["h"], "ok: 2 file(s)"),
]


@pytest.mark.parametrize("script, argv, words", FOLDER_NAMED_CSV_CASES)
def test_a_folder_named_like_a_csv_is_searched_not_read(work, capsys, monkeypatch, request, script, argv, words):
    write(work / "q/z.csv/inner_q_dataset.csv", Q_TEXT)
    write(work / "h/z_harmony.csv/inner_harmony.csv", HARMONY_TEXT)
    if script == "convert_to_harmony":
        tokenizer = request.getfixturevalue("tokenizer")
        monkeypatch.setattr(convert_to_harmony, "get_tokenizer", lambda source="": tokenizer)
    code, out, err = run_main(script, argv, capsys)
    assert code == 0 and "Traceback" not in err, err
    assert words in out


def test_check_data_lists_a_broken_link(work, capsys):
    os.symlink("gone.csv", work / "h/z_harmony.csv")
    assert_refused("check_data", ["h"], 1, ["h/z_harmony.csv", "broken link"], work, capsys, where="out")


# ---- 6. invalid UTF-8 and bad settings name the file, row and byte / the setting and value -------------------------
def with_bad_byte(text: str, after: str) -> bytes:
    data = text.encode()
    at = data.index(after.encode()) + len(after)
    return data[:at] + b"\xff" + data[at:]


# (script, argv, file, its bytes, exit status, words)
UTF8_CASES = [
    ("make_q_dataset", ["series/a.csv", "--OUT_DIR=out"], "series/a.csv", with_bad_byte(SERIES_TEXT, "T02:00:00,"),
     1, ["series/a.csv, row 3", "not valid UTF-8 at byte"]),
    ("calculate_reward", ["q"], "q/a_q_dataset.csv", with_bad_byte(Q_TEXT, "q2?"), 1,
     ["q/a_q_dataset.csv, row 2", "not valid UTF-8 at byte"]),  # in a folder, inside a quoted multi-line prompt
    ("calculate_reward", ["q"], "q/a_q_dataset.csv", with_bad_byte(Q_TEXT, "q_action_1"), 1,
     ["q/a_q_dataset.csv", "in the header"]),
    ("convert_to_harmony", ["q/a_q_dataset.csv"], "q/a_q_dataset.csv", with_bad_byte(Q_TEXT, "hi, "), 1,
     ["q/a_q_dataset.csv, row 1", "not valid UTF-8"]),
]


@pytest.mark.parametrize("script, argv, name, data, code, words", UTF8_CASES)
def test_invalid_utf8_names_file_row_and_byte(work, capsys, script, argv, name, data, code, words):
    write(work / name, data)
    assert_refused(script, argv, code, words, work, capsys)


def test_check_data_lists_invalid_utf8(work, capsys):
    write(work / "h/a_harmony.csv", with_bad_byte(HARMONY_TEXT, "2024-06-03T08:00:00,<|start|>system"))
    assert_refused("check_data", ["h"], 1, ["h/a_harmony.csv, row 1", "not valid UTF-8"], work, capsys, where="out")


def test_utf8_error_byte_offset_is_the_bad_byte(tmp_path):
    data = codecs.BOM_UTF8 + with_bad_byte(Q_TEXT, "q2?")
    path = write(tmp_path / "x.csv", data)
    with pytest.raises(fileio.InputError) as info:
        fileio.read_csv_text(path)
    offset = data.index(b"\xff")
    assert f"byte {offset} (0xff)" in str(info.value) and ", row 2:" in str(info.value)


# ---- 7. a byte-order mark (Excel's "CSV UTF-8") is accepted everywhere --------------------------------------------
@pytest.mark.parametrize("script, argv, name, text", [
    ("make_q_dataset", ["series/a.csv", "--OUT_DIR=out", "--RANDOM_POLICY_RUNS=0"], "series/a.csv", SERIES_TEXT),
    ("calculate_reward", ["q"], "q/a_q_dataset.csv", Q_TEXT),
    ("check_data", ["h"], "h/a_harmony.csv", HARMONY_TEXT),
])
def test_byte_order_mark_is_accepted(work, capsys, script, argv, name, text):
    write(work / name, codecs.BOM_UTF8 + text.encode())
    code, _, err = run_main(script, argv, capsys)
    assert code == 0, err


def test_series_with_byte_order_mark_gives_the_same_dataset(work, capsys):
    write(work / "series/b.csv", codecs.BOM_UTF8 + SERIES_TEXT.encode())
    assert run_main("make_q_dataset", ["series/a.csv", "series/b.csv", "--OUT_DIR=out", "--RANDOM_POLICY_RUNS=0"],
                    capsys)[0] == 0
    plain, marked = (work / "out/a_q_dataset.csv").read_text(), (work / "out/b_q_dataset.csv").read_text()
    assert plain.replace(",a,", ",b,") == marked  # only the series name differs


# ---- 8. accepted nonsense is refused: (script, argv, file to write or None, its text, exit status, words) -----------
def series_with(row: int, column: int, value: str) -> str:
    lines = SERIES_TEXT.splitlines()
    cells = lines[row].split(",")
    cells[column] = value
    lines[row] = ",".join(cells)
    return "\n".join(lines) + "\n"


NONSENSE_CASES = [
    ("make_q_dataset", ["series/a.csv", "--OUT_DIR=out"], "series/a.csv", series_with(3, 1, "1e308"), 1,
     ["series/a.csv, row 3, column 'co2_kg_per_kwh', value '1e308'", "at most 10 kg/kWh"]),
    ("make_q_dataset", ["series/a.csv", "--OUT_DIR=out"], "series/a.csv", series_with(12, 2, "25000"), 1,
     ["series/a.csv, row 12, column 'cooling_load_kw', value '25000'", "at most 1000 kW"]),
    ("convert_to_harmony", ["q", "--DATE=2025-13-45"], None, "", 2, ["--DATE='2025-13-45'", "not a real date"]),
    ("convert_to_harmony", ["q", "--DATE=2025-2-3"], None, "", 2, ["--DATE='2025-2-3'", "YYYY-MM-DD"]),
    ("convert_to_harmony", ["q", "--REASONING_EFFORT=max"], None, "", 2, ["--REASONING_EFFORT='max'"]),
    ("make_series", ["--N_WINDOWS=0"], None, "", 2, ["--N_WINDOWS=0", "1..10000"]),
    ("make_series", ["--N_WINDOWS=-3"], None, "", 2, ["--N_WINDOWS=-3"]),
    ("make_series", ["--CO2_MIN=nan"], None, "", 2, ["--CO2_MIN='nan'", "finite"]),
    ("make_series", ["--CO2_MAX=inf"], None, "", 2, ["--CO2_MAX='inf'", "finite"]),
    ("make_series", ["--CO2_MIN=0.6"], None, "", 2, ["--CO2_MIN=0.6", "CO2_MIN < CO2_MAX"]),
    ("make_series", ["--LOAD_MEAN_RANGE=30"], None, "", 2, ["--LOAD_MEAN_RANGE='30'", "two numbers"]),
    ("make_series", ["--WINDOW_PREFIX=../x"], None, "", 2, ["--WINDOW_PREFIX='../x'"]),
    ("check_data", ["h", "--SUM_TOLERANCE=" + "9" * 400], None, "", 2, ["--SUM_TOLERANCE='999", "finite"]),
    ("check_data", ["h", "--SUM_TOLERANCE=0.5"], None, "", 2, ["--SUM_TOLERANCE=0.5", "0..0.01"]),
    ("check_data", ["h", "--ARGMAX_TOLERANCE=-1"], None, "", 2, ["--ARGMAX_TOLERANCE=-1"]),
    ("calculate_reward", ["q", "--TAU=0"], None, "", 2, ["--TAU=0.0", "finite number > 0"]),
    ("calculate_reward", ["q", "--TAU=nan"], None, "", 2, ["--TAU='nan'", "finite"]),
    ("make_q_dataset", ["series/a.csv", "--OFF_TRAJECTORY_ENERGIES=abc"], None, "", 2,
     ["--OFF_TRAJECTORY_ENERGIES='abc'", "'abc' is not a number"]),
    ("make_q_dataset", ["series/a.csv", "--OFF_TRAJECTORY_ENERGIES=0,nan"], None, "", 2,
     ["--OFF_TRAJECTORY_ENERGIES='0,nan'", "outside 0..300"]),
    ("make_q_dataset", ["series/a.csv", "--INITIAL_ENERGY=301"], None, "", 2, ["--INITIAL_ENERGY=301.0"]),
    ("make_q_dataset", ["series/a.csv", "--OFF_TRAJECTORY_RANDOM=-1"], None, "", 2, ["--OFF_TRAJECTORY_RANDOM=-1"]),
]


@pytest.mark.parametrize("script, argv, name, text, code, words", NONSENSE_CASES)
def test_nonsense_is_refused(work, capsys, script, argv, name, text, code, words):
    if name:
        write(work / name, text)
    assert_refused(script, argv, code, words, work, capsys)


# ---- the same through real processes: exit status and stderr as a user sees them ----------------------------------
PROCESS_CASES = [
    ("make_series.py", ["--START_DATE=2024-02-30"], 2, "--START_DATE='2024-02-30'"),
    ("make_q_dataset.py", ["series/a.csv", "--OUT_DIR=q/a_q_dataset.csv"], 2, "is a file, not a folder"),
    ("calculate_reward.py", ["q/a_q_dataset.csv", "--overwrite", "false"], 0, ""),  # `false` is the flag's value
    ("convert_to_harmony.py", ["q", "--TOKENIZER=/no/such/folder"], 2, "the folder does not exist"),
]


@pytest.mark.parametrize("script, args, code, words", PROCESS_CASES)
def test_processes(work, script, args, code, words):
    before = snapshot(work)
    result = subprocess.run([sys.executable, str(REPO / script), *args], cwd=work, capture_output=True, text=True)
    assert result.returncode == code, result.stderr
    assert "Traceback" not in result.stderr
    if code:
        assert words in one_error_line(result.stderr) and snapshot(work) == before
    else:  # --overwrite false: a copy under OUT_DIR, the input untouched
        assert (work / "runs/rewards/q/a_q_dataset_with_reward.csv").exists()
        assert (work / "q/a_q_dataset.csv").read_bytes() == before["q/a_q_dataset.csv"][1]


# ---- 9. parse_action never raises: (completion text, expected action) -----------------------------------------------
F, RET = "<|channel|>final<|message|>", "<|return|>"
PARSE_CASES = [
    (f"{F}[{'9' * 5000}]{RET}", None),  # 5,000 digits: over Python's 4,300-digit int() limit, not an action
    (f"{F}[{'1' * 4301}]{RET}", None),  # just over the limit
    (f"{F}[-{'9' * 5000}]{RET}", None),  # huge negative
    (f"{F}[{'0' * 5000}2]{RET}", 2),  # leading zeros only: still the action 2, as int() would say
    (f"{F}[{'0' * 5000}]{RET}", 0),  # all zeros
    (f"{F}[-0]{RET}", 0),  # minus zero is zero, as int() says
    (f"{F}[-{'0' * 5000}3]{RET}", None),  # -3
    (f"{F}[{'9' * 5000}] then [1]{RET}", 1),  # the last bracketed integer counts
    (f"{F}[1] then [{'9' * 5000}]{RET}", None),
    (f"{F}[]{RET}", None),  # empty brackets
    (f"{F}[-]{RET}", None),  # a sign alone
    (f"{F}[1\x00]{RET}", None),  # a NUL inside
    (f"{F}\udcff[2]{RET}", 2),  # a lone surrogate around the answer
    (f"{F}" + "[" * 10000 + f"3]{RET}", 3),  # many open brackets
]


@pytest.mark.parametrize("text, expected", PARSE_CASES)
def test_parse_action_odd_inputs(text, expected):
    assert parse_action(text) == expected


FINAL_PIECES = st.sampled_from(["<|channel|>final<|message|>", "<|return|>", "<|end|>", "<|call|>", "[", "]", "-",
                                "<|start|>assistant", "<|channel|>analysis<|message|>", " commentary"])


@given(st.lists(st.one_of(st.text(max_size=20), FINAL_PIECES, st.integers().map(str),
                          st.integers(0, 6000).map(lambda n: "9" * n)), max_size=12).map("".join))
@settings(max_examples=300, deadline=None)
def test_parse_action_never_raises(text):
    action = parse_action(text)
    assert action is None or action in (0, 1, 2, 3)

