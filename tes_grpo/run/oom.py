"""A training run that runs out of GPU memory: one message naming the step and the setting to lower, and where
--RESUME=1 continues. Library module, not a script; train_grpo.main uses it:

    watch = StepWatch()                      # a TrainerCallback: the step in progress
    ...train(settings, callbacks=[watch])...
    except torch.OutOfMemoryError as err:
        print(out_of_memory_message(settings, watch.step, err, ...), file=sys.stderr)

Which setting: TRAIN_BATCH_SIZE when it is a fixed number (completions per forward/backward); with "auto" the memory
plan (memory_plan.py) sized the passes and generate calls from MEMORY_BUDGET_GB, so a smaller budget makes them
smaller; where there is no plan (FSDP, vLLM) TRAIN_TOKENS_PER_PASS caps auto's passes. MAX_COMPLETION_LEN always
applies: every pass and generate call grows with it.

Why the run folder stays resumable: checkpoints are written between optimizer steps, never during one, and a
resume takes the newest complete checkpoint and trims the logs' rows of later steps (run_folder.prepare_resume).

Before any of that, train_grpo.main (and benchmarks/bench_grpo.py) starts torch's CUDA allocator with expandable
segments (use_expandable_segments), so memory freed by one phase of a step is there for the next.
"""

from __future__ import annotations

import os
from pathlib import Path

from transformers import TrainerCallback

from tes_grpo.run.run_folder import how_to_go_on, where_stopped

ALLOCATOR_VARIABLE = "PYTORCH_CUDA_ALLOC_CONF"  # torch's setting of its CUDA caching allocator
GENERAL_VARIABLE = "PYTORCH_ALLOC_CONF"  # torch >= 2.9: the same for every device, read before the CUDA one
EXPANDABLE = "expandable_segments:True"


def use_expandable_segments(say, cuda_available: bool, cuda_started: bool, vllm: bool = False) -> str | None:
    """torch 2.11-2.13: has this process's CUDA caching allocator use expandable segments unless the user configured
    it; returns the value in effect ("" for torch's defaults, None without a GPU). Says what it did.

    Why: with fixed-size segments, each step alternates a generate call (its KV cache) and training passes (their
    activations), and the allocator ends up holding memory it cannot hand to the next phase: under a 24 GiB budget a
    second step's generate call ran out of memory with gigabytes reserved but unallocated (BENCHMARKS.md, "The
    experts kept in tile order"). Expandable segments map and unmap pages within one growing segment instead. torch
    reads the setting when its CUDA allocator starts, so this must run before the process's first CUDA call
    (cuda_started: torch.cuda.is_initialized()); after it, it changes nothing and says so. The variables are torch's
    interface for this setting; a value the user set in either is kept. vllm: left to torch's defaults, since vLLM
    manages its own memory pool (its sleep mode and custom all-reduce are known to conflict with expandable
    segments; not tried here)."""
    if not cuda_available:
        return None
    for variable in (GENERAL_VARIABLE, ALLOCATOR_VARIABLE):
        given = os.environ.get(variable)
        if given:
            say(f"CUDA allocator: {variable}={given} (as set; the default here is {EXPANDABLE})")
            return given
    if vllm:
        say("CUDA allocator: torch's defaults (USE_VLLM: vLLM manages its own memory)")
        return ""
    if cuda_started:
        say(f"CUDA allocator: torch's defaults (CUDA was started before {EXPANDABLE} could be set; set "
            f"{ALLOCATOR_VARIABLE}={EXPANDABLE} before starting to have it)")
        return ""
    os.environ[ALLOCATOR_VARIABLE] = EXPANDABLE
    say(f"CUDA allocator: {EXPANDABLE} ({ALLOCATOR_VARIABLE}; memory one phase of a step frees is there for the next)")
    return EXPANDABLE


class StepWatch(TrainerCallback):
    """Knows where training is: `step`, the optimizer step in progress (None before training starts), and `ended`,
    whether the last step is done (what fails then is the final save)."""

    def __init__(self):
        self.state = None
        self.ended = False

    def on_train_begin(self, args, state, control, **kwargs):
        self.state = state

    def on_train_end(self, args, state, control, **kwargs):
        self.ended = True

    @property
    def step(self) -> int | None:
        return None if self.state is None else self.state.global_step + 1


def settings_to_lower(s, memory_plan: bool) -> list[str]:
    """The settings that make a step need less GPU memory, for settings `s` (train_grpo's); memory_plan: whether
    TRAIN_BATCH_SIZE=auto was sized by the memory plan (one GPU per process, no vLLM) or by TRAIN_TOKENS_PER_PASS."""
    if str(s.TRAIN_BATCH_SIZE) != "auto":
        first = (f"TRAIN_BATCH_SIZE (now {s.TRAIN_BATCH_SIZE} completions per forward/backward; auto sizes it from "
                 "the GPU's memory)")
    elif not memory_plan:
        first = (f"TRAIN_TOKENS_PER_PASS (now {s.TRAIN_TOKENS_PER_PASS}: without a memory plan it caps "
                 "TRAIN_BATCH_SIZE=auto's passes)")
    elif s.MEMORY_BUDGET_GB:
        first = (f"MEMORY_BUDGET_GB (now {s.MEMORY_BUDGET_GB:g}: the plan sizes TRAIN_BATCH_SIZE=auto's passes and the "
                 "generate calls to fit it)")
    else:
        first = ("MEMORY_BUDGET_GB (now 0 = all the GPU's free memory: set it a few GiB below that, and the plan "
                 "sizes TRAIN_BATCH_SIZE=auto's passes and the generate calls smaller)")
    steps = s.GENERATION_STEPS
    return [first, f"MAX_COMPLETION_LEN (now {s.MAX_COMPLETION_LEN} tokens)"] + (
        [f"GENERATION_STEPS (now {steps}: a generation batch holds {steps} steps' completions)"] if steps > 1 else [])


def out_of_memory_message(s, step: int | None, error: BaseException, memory_plan: bool, ended: bool = False) -> str:
    """One message for a run stopped by torch.OutOfMemoryError: the step (ended: after the last one, while saving),
    what the allocator said (its first line), the settings to lower, and whether and from where --RESUME=1 continues
    (the newest complete checkpoint in s.OUT_DIR)."""
    said = str(error).strip().splitlines()[0] if str(error).strip() else type(error).__name__
    return (f"error: out of GPU memory {where_stopped(s.TOTAL_STEPS, step, ended)} ({said}). Lower "
            + ", or ".join(settings_to_lower(s, memory_plan))
            + f", and run again with the same OUT_DIR: {how_to_go_on(Path(s.OUT_DIR))}.")
