"""Which process this is when a script runs under `accelerate launch` (several GPUs), and what follows from it.

Not a script. One process (`python train_grpo.py`) is rank 0 of 1, and every helper here then does what a
single process would: print, write, no communication. Under `accelerate launch` (torchrun underneath), RANK,
LOCAL_RANK and WORLD_SIZE come from the environment, and:

- `say(...)` prints on rank 0 only, so informational lines appear once; `SayOnce` says each of its messages only
  the first time (a fallback met on every call, for example);
- `gather_on_main(items)` collects a list from every rank on rank 0 (in rank order), so a log is written once
  with every process's rows;
- `wait_for_everyone()` is a barrier (for example before renaming a folder other ranks were writing into);
- `uses_fsdp()` says whether accelerate shards the weights (FSDP), which changes how a model is loaded;
- `interrupts_held()` holds a Ctrl-C until a block (the import of torch) ends, then raises it.
"""

from __future__ import annotations

import contextlib
import os
import signal
import threading


def process_count() -> int:
    """Processes in this run (WORLD_SIZE; 1 without a launcher)."""
    return int(os.environ.get("WORLD_SIZE", "1"))


def process_rank() -> int:
    """This process's global rank (RANK; 0 without a launcher)."""
    return int(os.environ.get("RANK", "0"))


def local_rank() -> int:
    """This process's rank on its host, i.e. its GPU index (LOCAL_RANK; 0 without a launcher)."""
    return int(os.environ.get("LOCAL_RANK", "0"))


def is_main_process() -> bool:
    return process_rank() == 0


def say(message: str) -> None:
    """print() on rank 0 only."""
    if is_main_process():
        print(message, flush=True)


class SayOnce:
    """Says a message the first time its key comes and drops it after: `say_once(key, message)` (message defaults to
    the key) returns whether it said it. `say` is the function that says it: processes.say (rank 0) unless given."""

    def __init__(self, say=None):
        self._say = say
        self.said: set[str] = set()

    def __call__(self, key: str, message: str | None = None) -> bool:
        if key in self.said:
            return False
        self.said.add(key)
        (self._say or say)(key if message is None else message)
        return True


def uses_fsdp() -> bool:
    """Whether accelerate launched this process with FSDP (ACCELERATE_USE_FSDP, set from the config file)."""
    return os.environ.get("ACCELERATE_USE_FSDP", "false").strip().lower() in ("1", "true", "yes")


def _distributed():
    """torch.distributed when a process group with more than one process is up, else None."""
    if process_count() < 2:
        return None
    import torch.distributed as dist  # here: train_grpo imports processes before torch (--help)

    if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
        return dist
    return None


def start_process_group() -> None:
    """Joins the launcher's process group now (accelerate's PartialState: NCCL on GPUs, gloo on CPU).

    The Trainer would do it later; loading needs it earlier (tiny-model build on rank 0 first, FSDP loading).
    """
    if process_count() > 1:
        from accelerate import PartialState  # here: train_grpo imports processes before torch (--help)

        PartialState()


def wait_for_everyone() -> None:
    """Barrier across processes; nothing with one process."""
    dist = _distributed()
    if dist is not None:
        dist.barrier()


def gather_on_main(items: list) -> list | None:
    """Every rank's list concatenated in rank order on rank 0, None on the others; `items` with one process.

    A collective: every rank must call it the same number of times. Without a process group (ranks set, group not
    started) nothing can be gathered: rank 0 keeps its own items, the others get None.
    """
    dist = _distributed()
    if dist is None:
        return list(items) if is_main_process() else None
    gathered = [None] * dist.get_world_size() if dist.get_rank() == 0 else None
    dist.gather_object(list(items), gathered, dst=0)
    if gathered is None:
        return None
    return [item for part in gathered for item in part]


__all__ = ["SayOnce", "gather_on_main", "is_main_process", "local_rank", "process_count", "process_rank", "say",
           "start_process_group", "uses_fsdp", "wait_for_everyone"]


@contextlib.contextmanager
def interrupts_held():
    """Holds a Ctrl-C (SIGINT) that arrives inside the block and raises it as KeyboardInterrupt when the block ends.
    For `import torch`: its C++ initialisation runs Python code through pybind11, and a KeyboardInterrupt raised in
    there can abort the process ("terminate called after throwing an instance of 'pybind11::error_already_set'",
    exit -6; seen on the CPU about once in 20 Ctrl-Cs 0.2 s into the import) instead of unwinding to the caller's
    Ctrl-C message. Outside the main
    thread, where Python cannot set a signal handler, the block runs as it is."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    held = []
    previous = signal.signal(signal.SIGINT, lambda signum, frame: held.append(signum))
    try:
        yield
    finally:
        signal.signal(signal.SIGINT, previous)
    if held:
        raise KeyboardInterrupt
