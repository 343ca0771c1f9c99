"""tes_grpo/run/processes.py's SayOnce (a message said the first time its key comes, on rank 0 only by default) and
interrupts_held (a Ctrl-C held to the end of a block)."""

from __future__ import annotations

import os
import signal
import threading

import pytest

from tes_grpo.run.processes import SayOnce, interrupts_held


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


def test_a_ctrl_c_inside_interrupts_held_is_raised_when_the_block_ends():
    before = signal.getsignal(signal.SIGINT)
    reached = []
    with pytest.raises(KeyboardInterrupt):
        with interrupts_held():
            os.kill(os.getpid(), signal.SIGINT)
            for _ in range(1000):  # Python runs the handler between bytecodes: the block goes on all the same
                pass
            reached.append("end of the block")
    assert reached == ["end of the block"]
    assert signal.getsignal(signal.SIGINT) is before


def test_interrupts_held_without_a_ctrl_c_raises_nothing_and_restores_the_handler():
    before = signal.getsignal(signal.SIGINT)
    with interrupts_held():
        pass
    assert signal.getsignal(signal.SIGINT) is before


def test_interrupts_held_outside_the_main_thread_runs_the_block():
    # Python sets signal handlers only in the main thread: elsewhere the block runs unguarded, without an error
    ran, errors = [], []

    def work():
        try:
            with interrupts_held():
                ran.append(True)
        except ValueError as err:
            errors.append(err)

    thread = threading.Thread(target=work)
    thread.start()
    thread.join()
    assert ran == [True] and errors == []
