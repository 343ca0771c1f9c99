"""tes_grpo/model/tiny_model.py: the tiny checkpoint is built once when several processes ask for it at the same
time."""

import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]


@pytest.mark.slow
def test_processes_asking_at_once_build_the_tiny_checkpoint_once(tmp_path):
    # two test runs (or two launches) start together on a fresh machine: without the lock each built the folder
    # and replaced it while the other's processes loaded from it
    command = [sys.executable, "-m", "tes_grpo.model.tiny_model", f"--TINY_DIR={tmp_path / 'tiny'}", "--WARMUP_STEPS=0"]
    running = [subprocess.Popen(command, cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
               for _ in range(2)]
    outputs = [process.communicate(timeout=300)[0] for process in running]
    assert [process.returncode for process in running] == [0, 0], outputs
    built = [out for out in outputs if "wrote the tiny MXFP4 checkpoint" in out]
    cached = [out for out in outputs if "using the cached tiny gpt-oss" in out]
    assert (len(built), len(cached)) == (1, 1), outputs
    assert (tmp_path / "tiny" / "tiny_model.json").is_file()
