"""A run that runs out of GPU memory mid-run (tes_grpo/run/oom.py, train_grpo.main): one message naming the step and
the settings to lower, a non-zero exit, and a run folder that --RESUME=1 continues. The allocator's failure is
mocked on the CPU: a callback raises torch.OutOfMemoryError when the failing step begins."""

from __future__ import annotations

import json

import pandas as pd
import pytest
import torch
from grpo_fixtures import write_fixture_data
from transformers import TrainerCallback

import train_grpo
from tes_grpo.run.oom import out_of_memory_message, settings_to_lower

FAIL_AT, SAVE_STEPS, TOTAL = 3, 2, 3
ALLOCATOR_SAYS = "CUDA out of memory. Tried to allocate 2.00 GiB. GPU 0 has a total capacity of 79.19 GiB"


class OutOfMemoryAt(TrainerCallback):
    """Raises what the CUDA caching allocator raises, when optimizer step `step` begins."""

    def __init__(self, step: int):
        self.step = step

    def on_step_begin(self, args, state, control, **kwargs):
        if state.global_step + 1 == self.step:
            raise torch.OutOfMemoryError(ALLOCATOR_SAYS)


# (settings, memory plan, the setting named first)
LOWER = [
    ({"TRAIN_BATCH_SIZE": "4"}, True, "TRAIN_BATCH_SIZE (now 4"),
    ({"TRAIN_BATCH_SIZE": "auto", "MEMORY_BUDGET_GB": 0.0}, True, "MEMORY_BUDGET_GB (now 0 = all"),
    ({"TRAIN_BATCH_SIZE": "auto", "MEMORY_BUDGET_GB": 24.0}, True, "MEMORY_BUDGET_GB (now 24:"),
    ({"TRAIN_BATCH_SIZE": "auto"}, False, "TRAIN_TOKENS_PER_PASS (now 40000"),
]


@pytest.mark.parametrize("overrides, planned, first", LOWER)
def test_settings_to_lower(overrides, planned, first):
    settings = train_grpo.default_settings(**overrides)
    lower = settings_to_lower(settings, planned)
    assert lower[0].startswith(first) and lower[1] == "MAX_COMPLETION_LEN (now 4000 tokens)"


# (GENERATION_STEPS, the last setting named)
LAST_TO_LOWER = [
    (1, "MAX_COMPLETION_LEN (now 4000 tokens)"),  # one step a batch: nothing to say
    (2, "GENERATION_STEPS (now 2: a generation batch holds 2 steps' completions)"),  # a larger batch to shrink
]


@pytest.mark.parametrize("steps, last", LAST_TO_LOWER)
def test_a_larger_generation_batch_is_named_last(steps, last):
    assert settings_to_lower(train_grpo.default_settings(GENERATION_STEPS=steps), True)[-1] == last


def test_message_without_a_checkpoint(tmp_path):
    settings = train_grpo.default_settings(OUT_DIR=str(tmp_path / "run"), TRAIN_BATCH_SIZE="8")
    message = out_of_memory_message(settings, None, torch.OutOfMemoryError(ALLOCATOR_SAYS + "\nmore"), True)
    assert message.startswith("error: out of GPU memory before the first training step (CUDA out of memory. Tried")
    assert "\n" not in message and "no checkpoint was written yet" in message


@pytest.mark.slow
def test_out_of_memory_mid_run_is_one_message_and_the_run_resumes(tmp_path, tokenizer, capsys, monkeypatch):
    monkeypatch.delenv("GRPO_COMPLETION_LOG_PATH", raising=False)
    monkeypatch.delenv("GRPO_LOG_COMPLETIONS", raising=False)
    data = write_fixture_data(tmp_path, tokenizer)
    out = tmp_path / "run"
    argv = ["--MODEL_ID=tiny", f"--DATA_DIR={data}", f"--EVAL_DIR={data / 'eval'}", f"--OUT_DIR={out}",
            "--NUM_GENERATIONS=2", "--GRADIENT_ACCUMULATION_STEPS=1", "--TRAIN_BATCH_SIZE=2",
            "--MAX_COMPLETION_LEN=16", f"--SAVE_STEPS={SAVE_STEPS}", f"--TOTAL_STEPS={TOTAL}"]
    capsys.readouterr()
    assert train_grpo.main(argv, callbacks=[OutOfMemoryAt(FAIL_AT)]) == 1
    err = capsys.readouterr().err
    lines = [line for line in err.splitlines() if line.startswith("error:")]
    assert len(lines) == 1 and "Traceback" not in err, err
    message = lines[0]
    assert f"out of GPU memory in step {FAIL_AT} of {TOTAL} (CUDA out of memory. Tried to allocate 2.00 GiB." in message
    assert "Lower TRAIN_BATCH_SIZE (now 2 " in message and "MAX_COMPLETION_LEN (now 16 tokens)" in message
    checkpoint = out / f"checkpoint-{SAVE_STEPS:06d}"
    assert f"--RESUME=1 continues from {checkpoint} (step {SAVE_STEPS})" in message
    assert sorted(p.name for p in out.glob("checkpoint-*")) == [checkpoint.name]

    assert train_grpo.main(argv + ["--RESUME=1"]) == 0
    assert f"resuming from {checkpoint} at step {SAVE_STEPS}" in capsys.readouterr().out
    assert json.loads((out / "trainer_state.json").read_text())["global_step"] == TOTAL
    log = pd.read_csv(out / "completions.csv", dtype=str, keep_default_na=False)
    assert log.groupby("step").size().to_dict() == {str(step): 2 for step in range(1, TOTAL + 1)}


def test_message_after_the_last_step(tmp_path):
    # the final save can run out of memory too: then no step is in progress, and "step 31 of 30" would mislead
    settings = train_grpo.default_settings(OUT_DIR=str(tmp_path / "run"), TOTAL_STEPS=30)
    message = out_of_memory_message(settings, 31, torch.OutOfMemoryError(ALLOCATOR_SAYS), True, ended=True)
    assert message.startswith("error: out of GPU memory after the last step (30), while saving the adapter")
    assert "step 31" not in message


# ((PYTORCH_CUDA_ALLOC_CONF, PYTORCH_ALLOC_CONF) before, a GPU?, CUDA started?, vLLM?; the value in effect,
#  PYTORCH_CUDA_ALLOC_CONF after, words said)
ALLOCATOR_CASES = [
    ((None, None), True, False, False, "expandable_segments:True", "expandable_segments:True", "allocator: expandable"),
    (("max_split_size_mb:256", None), True, False, False, "max_split_size_mb:256", "max_split_size_mb:256",
     "as set"),  # the user's own, kept
    ((None, "backend:native"), True, False, False, "backend:native", None, "PYTORCH_ALLOC_CONF=backend:native"),
    ((None, None), True, True, False, "", None, "CUDA was started before"),  # too late: said, nothing changed
    ((None, None), True, False, True, "", None, "vLLM manages its own memory"),  # USE_VLLM: torch's defaults
    ((None, None), False, False, False, None, None, None),  # no GPU: nothing to set, nothing said
]


@pytest.mark.parametrize("before, gpu, started, vllm, effect, after, words", ALLOCATOR_CASES)
def test_use_expandable_segments(monkeypatch, before, gpu, started, vllm, effect, after, words):
    import os

    from tes_grpo.run.oom import ALLOCATOR_VARIABLE, GENERAL_VARIABLE, use_expandable_segments

    for variable, value in zip((ALLOCATOR_VARIABLE, GENERAL_VARIABLE), before, strict=True):
        monkeypatch.setenv(variable, value or "")  # recorded: whatever the call sets is undone after the test
        if value is None:
            monkeypatch.delenv(variable)
    said = []
    assert use_expandable_segments(said.append, gpu, started, vllm=vllm) == effect
    assert os.environ.get(ALLOCATOR_VARIABLE) == after
    assert (words is None and not said) or (len(said) == 1 and words in said[0])


def test_train_grpo_sets_the_allocator_before_training(monkeypatch):
    """train_grpo.main decides the allocator before train() can touch CUDA, with the run's USE_VLLM."""
    import train_grpo
    from tes_grpo.run import oom

    calls = []
    monkeypatch.setattr(oom, "use_expandable_segments",
                        lambda say, gpu, started, vllm=False: calls.append(("allocator", vllm)))
    monkeypatch.setattr(train_grpo, "train", lambda settings, callbacks=(), start=None: calls.append(("train", None)))
    assert train_grpo.main(["--MODEL_ID=tiny", "--USE_VLLM=1"]) == 0
    assert calls == [("allocator", True), ("train", None)]


def test_out_of_memory_is_one_line_and_exit_1(tmp_path, capsys, monkeypatch):
    """main's out-of-memory path without a model: the step the watch saw, one line, exit 1."""
    from types import SimpleNamespace

    def out_of_memory(settings, callbacks=(), start=None):
        callbacks[-1].on_train_begin(None, SimpleNamespace(global_step=2), None)  # train_grpo's StepWatch
        raise torch.OutOfMemoryError(ALLOCATOR_SAYS)

    monkeypatch.setattr(train_grpo, "train", out_of_memory)
    out = tmp_path / "run"
    assert train_grpo.main(["--MODEL_ID=tiny", f"--OUT_DIR={out}", "--TOTAL_STEPS=10", "--SAVE_STEPS=2"]) == 1
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("error: out of GPU memory in step 3 of 10 (CUDA out of memory."), err
    assert f"no checkpoint was written yet; {out} holds no run yet" in err[0]


class FakeGraph:
    """torch.cuda.CUDAGraph as far as keep_generator_registered uses it: the generators it was registered with."""

    def __init__(self):
        self.generators = []

    def register_generator_state(self, generator):
        self.generators.append(generator)


def test_captures_never_allocate_for_the_generator(monkeypatch):
    """Out of memory in a CUDA graph capture must stay an exception train_grpo can say in one line, never a graph
    half registered with the generator whose destructor aborts the process (torch 2.11): every DecodeGraphs (one per
    generate call) first makes sure one graph per device stays registered for good (decode_cache)."""
    from tes_grpo.sampling import decode_cache

    monkeypatch.setattr(decode_cache, "_GENERATOR_ANCHORS", {})
    monkeypatch.setattr(torch.cuda, "CUDAGraph", FakeGraph)
    monkeypatch.setattr(torch.cuda, "default_generators", ("generator 0", "generator 1"))
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    monkeypatch.setattr(torch.cuda, "graph_pool_handle", lambda: "pool")
    for _ in range(3):  # three generate calls on the current device
        decode_cache.DecodeGraphs(None, None, batch=2, device=torch.device("cpu"))
    decode_cache.keep_generator_registered(torch.device("cuda", 1))
    anchors = decode_cache._GENERATOR_ANCHORS
    assert {index: graph.generators for index, graph in anchors.items()} == {0: ["generator 0"], 1: ["generator 1"]}
