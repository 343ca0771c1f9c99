"""tes_grpo/run/processes.py's SayOnce: a message said the first time its key comes, on rank 0 only by default."""

from __future__ import annotations

from tes_grpo.run.processes import SayOnce


def test_say_once_says_each_key_once():
    said = []
    say_once = SayOnce(said.append)
    assert say_once("no-triton", "no triton: torch's codec")
    assert not say_once("no-triton", "no triton: torch's codec, again")
    assert say_once("padded") and not say_once("padded")  # the key is the message when none is given
    assert said == ["no triton: torch's codec", "padded"]


def test_say_once_defaults_to_rank_0(monkeypatch, capsys):
    monkeypatch.setenv("RANK", "1")
    assert SayOnce()("key", "on rank 1")  # counted as said, printed nowhere: rank 0 says it
    monkeypatch.setenv("RANK", "0")
    assert SayOnce()("key", "on rank 0")
    assert capsys.readouterr().out == "on rank 0\n"
