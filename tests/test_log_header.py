"""benchmarks/log_header.py: the header every benchmark, profile, GPU-suite part and drill log begins with (command,
commit and changes, GPU, copy rate, versions), on the CPU: in a git checkout, in a copy without .git with and without
the tree record, and with a GPU stood in for."""

from __future__ import annotations

import json
import shutil
import subprocess

import pytest
import torch

from benchmarks import log_header


def git(root, *args):
    subprocess.run(["git", "-C", str(root), "-c", "user.name=t", "-c", "user.email=t@t", *args], check=True,
                   capture_output=True)


@pytest.fixture
def checkout(tmp_path):
    """A git checkout with two committed files and an ignored one."""
    if shutil.which("git") is None:
        pytest.skip("git is not installed")
    root = tmp_path / "repo"
    (root / "pkg").mkdir(parents=True)
    (root / "a.txt").write_text("a\n")
    (root / "pkg" / "b.py").write_text("b = 1\n")
    (root / ".gitignore").write_text("ignored/\n")
    (root / "ignored").mkdir()
    (root / "ignored" / "big.bin").write_bytes(b"\0" * 10)
    git(root, "init", "-q")
    git(root, "add", "-A")
    git(root, "commit", "-q", "-m", "first")
    return root


def short_head(root) -> str:
    return subprocess.run(["git", "-C", str(root), "rev-parse", "--short", "HEAD"], capture_output=True, text=True,
                          check=True).stdout.strip()


def test_the_commit_and_a_clean_tree(checkout):
    assert log_header.commit_line(checkout) == f"commit: {short_head(checkout)}, tree clean"


def test_changes_make_the_tree_dirty_and_are_named(checkout):
    (checkout / "a.txt").write_text("changed\n")
    (checkout / "new.py").write_text("")
    (checkout / "ignored" / "more.bin").write_bytes(b"1")  # ignored: not a change
    line = log_header.commit_line(checkout)
    assert line == f"commit: {short_head(checkout)} with uncommitted changes in 2 path(s) (M a.txt, ?? new.py)"


def test_many_changes_are_counted_not_all_named(checkout):
    for i in range(log_header._SHOWN_PATHS + 3):
        (checkout / f"n{i}.py").write_text("")
    assert log_header.commit_line(checkout).endswith(" and 3 more)")


def copy_without_git(root, to):
    """What the GPU machine gets: the travelling files, no .git (the record only when written and carried)."""
    for name in log_header.travelling_files(root):
        (to / name).parent.mkdir(parents=True, exist_ok=True)
        shutil.copy(root / name, to / name)
    return to


def test_a_copy_without_git_or_record_says_unknown(checkout, tmp_path):
    copy = copy_without_git(checkout, tmp_path / "copy")
    assert not (copy / ".git").exists()
    assert log_header.commit_line(copy).startswith("commit: unknown (no .git, and no .tree-record.json")


def test_a_copy_with_the_record_names_the_commit_and_checks_the_files(checkout, tmp_path):
    (checkout / "a.txt").write_text("changed\n")
    log_header.write_record(checkout)
    assert log_header.git_state(checkout)[1] == ["M a.txt"]  # the record itself is no change
    copy = copy_without_git(checkout, tmp_path / "copy")
    shutil.copy(checkout / log_header._TREE_RECORD, copy)  # carried: git ignores it in the repo
    head = short_head(checkout)
    line = log_header.commit_line(copy)
    assert line.startswith(f"commit: {head} with uncommitted changes in 1 path(s) (M a.txt) (from .tree-record.json")
    assert "; the 3 files it lists match this tree" in line  # .gitignore, a.txt, pkg/b.py
    (copy / "pkg" / "b.py").write_text("b = 2\n")  # the tree moved on after the record was written
    line = log_header.commit_line(copy)
    assert "but 1 of the 3 files it lists differ here: pkg/b.py: the record is older than this tree" in line


def test_a_matching_record_names_the_commit_over_a_git_of_another_commit(checkout, tmp_path):
    """The GPU machine's copy can sit on a .git of an older commit: the record written here names the right one."""
    old = short_head(checkout)
    (checkout / "a.txt").write_text("newer\n")
    subprocess.run(["git", "-C", str(checkout), "commit", "-qam", "newer"], check=True)
    log_header.write_record(checkout)
    record = json.loads((checkout / log_header._TREE_RECORD).read_text())
    subprocess.run(["git", "-C", str(checkout), "reset", "-q", "--soft", old], check=True)  # .git back, files not
    line = log_header.commit_line(checkout)
    assert line.startswith(f"commit: {record['commit']}, tree clean (from .tree-record.json") and old not in line
    (checkout / "a.txt").write_text("moved on\n")  # the record no longer matches: git's own state is said
    assert log_header.commit_line(checkout).startswith(f"commit: {old} with uncommitted changes")


def test_a_broken_record_says_so(tmp_path):
    (tmp_path / log_header._TREE_RECORD).write_text("{not json")
    assert log_header.commit_line(tmp_path).startswith("commit: unknown (no .git; .tree-record.json is not a record")


def test_a_folder_inside_another_checkout_is_not_that_checkout(checkout):
    inner = checkout / "ignored"  # inside the repo, but not its top: a copy placed there has no commit of its own
    assert log_header.git_state(inner) is None
    assert log_header.commit_line(inner).startswith("commit: unknown (no .git")


def test_the_header_fields_without_a_gpu(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    monkeypatch.setattr(log_header, "_machine_gpus", lambda: [])
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "")
    lines = log_header.header(command="python benchmarks/bench_x.py --A=1").splitlines()
    assert [line.split(":")[0] for line in lines] == ["command", "commit", "gpu", "versions"]
    assert lines[0] == "command: python benchmarks/bench_x.py --A=1"
    assert lines[2] == "gpu: no GPU (CUDA_VISIBLE_DEVICES='')"
    for library in ("python", "torch", "CUDA", "transformers", "trl", "peft", "accelerate", "triton"):
        assert f"{library} " in lines[3], library


def test_hidden_gpus_are_named_from_nvidia_smi(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    monkeypatch.setattr(log_header, "_machine_gpus", lambda: ["NVIDIA H200", "NVIDIA H200"])
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    assert log_header.gpu_line() == "gpu: no GPU (the machine has 2 x NVIDIA H200)"


def test_the_header_with_gpus_and_a_copy_rate(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: "NVIDIA H200")
    lines = log_header.header(command="x", copy_rate=4.114e12).splitlines()
    assert lines[2] == "gpu: 2 x NVIDIA H200"
    assert lines[3].startswith("copy rate: 4.114 TB/s on NVIDIA H200 (device-to-device copy")
    assert lines[4].startswith("versions: ")


def test_the_command_is_this_process_argv_and_a_launcher_child_says_so(monkeypatch):
    monkeypatch.setattr(log_header._sys, "orig_argv", ["python3", "benchmarks/bench_grpo.py", "--STEPS=2", "a b"])
    monkeypatch.setenv("WORLD_SIZE", "1")
    assert log_header.command_line() == "command: python3 benchmarks/bench_grpo.py --STEPS=2 'a b'"
    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.setenv("RANK", "0")
    assert log_header.command_line().endswith("(rank 0 of 2 processes started by a launcher)")


def test_the_script_prints_the_header_with_the_command_given(capsys):
    assert log_header.main(["--COMMAND=bash tests/gpu_suite.sh cuda: python3 -m pytest -q"]) == 0
    out = capsys.readouterr().out.splitlines()
    assert out[0] == "command: bash tests/gpu_suite.sh cuda: python3 -m pytest -q"
    assert out[1].startswith("commit: ") and out[2].startswith("gpu: ") and out[3].startswith("versions: ")


def test_bench_memory_begins_with_the_header_without_a_gpu(capsys):
    from benchmarks import bench_memory

    assert bench_memory.main(["--FSDP_TABLE=1"]) == 0
    out = capsys.readouterr().out.splitlines()
    assert [line.split(":")[0] for line in out[:4]] == ["command", "commit", "gpu", "versions"]
