"""tes_grpo/run/run_folder.py's readers of a run's logs on resume: a torn last completion-log row whose step is at or
before the checkpoint (the step filter keeps such a row, so only the cut at the last line break drops it), and
metrics.jsonl's lines (only a torn last line is dropped; any other line that is not JSON is an error naming it)."""

from __future__ import annotations

import csv
import io
import json

import pytest

from tes_grpo.run.fileio import InputError
from tes_grpo.run.run_folder import drop_log_rows_after, read_completion_log, read_metrics

HEADER = ["step", "micro_step", "prompt", "completion", "action", "reward", "truncated", "target_action", "rank"]


def quoted(rows: list[list]) -> str:
    """Rows as CompletionLog writes them: every field quoted, \\n after each row."""
    buffer = io.StringIO()
    csv.writer(buffer, lineterminator="\n", quoting=csv.QUOTE_ALL).writerows(rows)
    return buffer.getvalue()


COMPLETE = [[1, 0, "p\nq", "c1", 1, 0.5, 0, 1, 0], [2, 0, "p\nq", "c2", 1, 0.5, 0, 1, 0]]
# a step-2 row cut short, every field present (so the field count cannot tell it from a whole row)
TORN = [
    '"2","1","p\nq","c2","1","0.5","0","1","',  # inside the last quoted field
    '"2","1","p\nq","c2","1","0.5","0","1","1',  # its value written, the closing quote not
    '2,1,"p\nq",c2,1,0.5,0,1,',  # unquoted, the last value not written
]


@pytest.mark.parametrize("checkpoint", [2, 3], ids=["torn-at-checkpoint", "torn-before-checkpoint"])
@pytest.mark.parametrize("torn", TORN, ids=["open-quote", "value-no-quote", "unquoted"])
def test_a_torn_row_at_or_before_the_checkpoint_is_dropped(tmp_path, torn, checkpoint):
    path = tmp_path / "completions.csv"
    path.write_bytes((quoted([HEADER, *COMPLETE]) + torn).encode())
    said = []
    header, rows, was_torn = read_completion_log(path, said.append)
    assert (header, rows, was_torn) == (HEADER, [[str(v) for v in row] for row in COMPLETE], True)
    drop_log_rows_after(tmp_path, checkpoint, path, said.append)  # the step filter keeps step 2 either way
    assert path.read_text() == quoted([HEADER, *COMPLETE])
    assert any("dropping a torn last row" in line for line in said), said


def test_a_whole_last_row_without_its_line_break_counts_as_torn(tmp_path):
    # the file ends right after the last field's closing quote: the row may be whole, but a write was cut before its
    # line break, so it is dropped as torn like any other (the next run redoes the step)
    path = tmp_path / "completions.csv"
    path.write_bytes((quoted([HEADER, *COMPLETE]) + quoted([[2, 1, "p", "c", 1, 0.5, 0, 1, 0]]).rstrip("\n")).encode())
    assert read_completion_log(path, lambda _: None)[1:] == ([[str(v) for v in row] for row in COMPLETE], True)


def metrics(*lines: str) -> str:
    return "".join(line + "\n" for line in lines)


def test_metrics_keep_every_json_line_and_skip_blank_ones(tmp_path):
    path = tmp_path / "metrics.jsonl"
    path.write_text(metrics(json.dumps({"step": 1}), "", "  ", json.dumps({"step": 2})))
    assert read_metrics(path, lambda _: None) == [{"step": 1}, {"step": 2}]


def test_a_torn_last_metrics_line_is_dropped_with_a_note(tmp_path):
    path = tmp_path / "metrics.jsonl"
    path.write_text(metrics(json.dumps({"step": 1})) + '{"step": 2, "rew')
    said = []
    assert read_metrics(path, said.append) == [{"step": 1}]
    assert said and "dropping the torn last line 2" in said[0] and str(path) in said[0]


@pytest.mark.parametrize("bad, number", [
    ('{"step": 2, "rew', 2),  # a torn line with whole lines after it: not the last, so not a cut write
    ("not json at all", 2),
    ("{'step': 2}", 2),  # Python's repr, not JSON
])
def test_a_bad_metrics_line_before_the_last_is_an_error_naming_it(tmp_path, bad, number):
    path = tmp_path / "metrics.jsonl"
    path.write_text(metrics(json.dumps({"step": 1}), bad, json.dumps({"step": 3})))
    with pytest.raises(InputError, match=rf"line {number} is not JSON \(.+\): ") as error:
        read_metrics(path, lambda _: None)
    assert str(error.value).startswith(f"{path}: ") and repr(bad[:80]) in str(error.value)


def test_resume_stops_on_a_bad_metrics_line_instead_of_dropping_it(tmp_path):
    # drop_log_rows_after rewrites metrics.jsonl from what read_metrics returns: dropping a bad line there would lose
    # it from the run's record for good
    (tmp_path / "metrics.jsonl").write_text(metrics(json.dumps({"step": 1}), "garbage", json.dumps({"step": 2})))
    with pytest.raises(InputError, match="line 2 is not JSON"):
        drop_log_rows_after(tmp_path, 1, None, lambda _: None)
    assert "garbage" in (tmp_path / "metrics.jsonl").read_text()
