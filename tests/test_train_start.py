"""train_grpo.py as a new user meets it when a run starts or stops: the errors a second or two in, before torch is
imported (run folder, data, model and tokenizer sources), and Ctrl-C: one line saying the step it stopped in and how
the run goes on, exit 130, no traceback. No model is loaded here."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from types import SimpleNamespace

import pytest

import train_grpo

REPO = Path(__file__).resolve().parents[1]

# (argv ({tmp}: the test's folder), environment, words of the one error line)
EARLY_EXITS = [
    (["--OUT_DIR={tmp}/held"], {}, "error: {tmp}/held: already holds a run (metrics.jsonl); pass --RESUME=1"),
    (["--OUT_DIR={tmp}/new", "--DATA_DIR={tmp}/none"], {}, "error: {tmp}/none: no training files matching"),
    (["--OUT_DIR={tmp}/new", "--RESUME=1"], {}, "holds no run yet: a plain run (without --RESUME) starts one there"),
    (["--OUT_DIR={tmp}/new", "--MODEL_ID=tinyy"], {}, "error: MODEL_ID='tinyy' (did you mean tiny?): not a folder"),
    (["--OUT_DIR={tmp}/new", "--MODEL_ID={tmp}/nothere"], {}, "error: MODEL_ID='{tmp}/nothere': no such folder"),
    (["--OUT_DIR={tmp}/new"], {"GPT_OSS_TOKENIZER": "/nonexistent/tok"},
     "error: GPT_OSS_TOKENIZER='/nonexistent/tok': no such folder; set GPT_OSS_TOKENIZER to a folder with gpt-oss's "
     "tokenizer.json"),
]

_RUN_CASES = """
import contextlib, io, json, os, sys
import train_grpo
results = []
for argv, environ in json.loads(sys.argv[1]):
    saved = dict(os.environ)
    os.environ.update(environ)
    err = io.StringIO()
    with contextlib.redirect_stderr(err), contextlib.redirect_stdout(io.StringIO()):
        code = train_grpo.main(["--MODEL_ID=tiny", *argv])
    os.environ.clear()
    os.environ.update(saved)
    results.append([code, err.getvalue()])
print(json.dumps({"results": results, "imported": sorted({"torch", "transformers", "trl"} & set(sys.modules))}))
"""


def test_early_exits_come_before_torch_is_imported(tmp_path):
    """Each case in a fresh process (one for all): one error line, exit 1, and torch, transformers, TRL never
    imported; a second or two each instead of the 7-16 s their imports took (offline: no Hub asked)."""
    (tmp_path / "held").mkdir()
    (tmp_path / "held" / "metrics.jsonl").write_text('{"step": 1}\n')
    cases = [[[arg.format(tmp=tmp_path) for arg in argv], environ] for argv, environ, _ in EARLY_EXITS]
    done = subprocess.run([sys.executable, "-c", _RUN_CASES, json.dumps(cases)], cwd=REPO, capture_output=True,
                          text=True, env={**os.environ, "HF_HUB_OFFLINE": "1"}, timeout=300)
    assert done.returncode == 0, done.stderr
    answer = json.loads(done.stdout.strip().splitlines()[-1])
    assert answer["imported"] == []
    for (code, err), (_, _, words) in zip(answer["results"], EARLY_EXITS, strict=True):
        lines = err.strip().splitlines()
        assert code == 1 and len(lines) == 1 and "Traceback" not in err, err
        assert words.format(tmp=tmp_path) in lines[0], lines[0]


# (checkpoints in OUT_DIR, the step Ctrl-C comes in (None: before training), the line said)
INTERRUPTS = [
    ([2], 4, "stopped by Ctrl-C in step 4 of 10; --RESUME=1 continues from {out}/checkpoint-000002 (step 2)"),
    ([], 1, "stopped by Ctrl-C in step 1 of 10; no checkpoint was written yet; the run in {out} stopped before its "
            "first checkpoint, so it cannot be continued: a plain run (without --RESUME) starts over there once its "
            "metrics.jsonl are removed, or in another --OUT_DIR"),
    (None, None, "stopped by Ctrl-C before the first training step; no checkpoint was written yet; {out} holds no run "
                 "yet: a plain run (without --RESUME) starts one there"),
]


@pytest.mark.parametrize("checkpoints, step, line", INTERRUPTS)
def test_ctrl_c_says_the_step_and_how_to_go_on(tmp_path, capsys, monkeypatch, checkpoints, step, line):
    out = tmp_path / "run"

    def interrupted(settings, callbacks=(), start=None):
        out.mkdir()  # what the run had written when Ctrl-C came
        (out / "metrics.jsonl").write_text("".join(json.dumps({"step": n}) + "\n" for n in range(1, step)))
        for number in checkpoints:
            folder = out / f"checkpoint-{number:06d}"
            folder.mkdir()
            (folder / "trainer_state.json").write_text(json.dumps({"global_step": number}))
        callbacks[-1].on_train_begin(None, SimpleNamespace(global_step=step - 1), None)  # train_grpo's StepWatch
        raise KeyboardInterrupt

    if checkpoints is None:  # Ctrl-C while the run was still starting
        monkeypatch.setattr(train_grpo, "preflight", lambda *args, **kwargs: (_ for _ in ()).throw(KeyboardInterrupt))
    else:
        monkeypatch.setattr(train_grpo, "train", interrupted)
    code = train_grpo.main(["--MODEL_ID=tiny", f"--OUT_DIR={out}", "--TOTAL_STEPS=10", "--SAVE_STEPS=2"])
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 130 and len(err) == 1 and err[0].startswith(line.format(out=out)), err


def test_ctrl_c_in_a_real_process_is_one_line_and_exit_130(tmp_path):
    """SIGINT as a terminal sends it, while the run imports torch after its checks: no traceback, exit 130."""
    out = tmp_path / "run"
    process = subprocess.Popen([sys.executable, "train_grpo.py", "--MODEL_ID=tiny", f"--OUT_DIR={out}"], cwd=REPO,
                               stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                               env={**os.environ, "PYTHONUNBUFFERED": "1"})
    first = process.stdout.readline()  # "training data: ..." is said by the checks, before torch is imported
    time.sleep(0.2)
    process.send_signal(signal.SIGINT)
    _, err = process.communicate(timeout=120)
    assert first.startswith("training data:"), first
    assert process.returncode == 130 and "Traceback" not in err, err
    assert err.strip().splitlines()[-1].startswith("stopped by Ctrl-C before the first training step"), err
