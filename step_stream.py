"""StepStream: the endless, seeded stream of training prompts that GRPO reads; run it to preview a run's prompts.

    .venv/bin/python step_stream.py                     # the first 3 optimizer steps' prompts at train_grpo's defaults
    .venv/bin/python step_stream.py --MODEL_ID=tiny     # ... of the tiny run (train_grpo.py's preset, presets.py)
    .venv/bin/python step_stream.py --STEPS=10 --SEED=7 # any of train_grpo.py's stream settings can be given

It draws the prompts of `steps_per_draw` micro-steps at a time, PROMPTS_PER_STEP per micro-step, all distinct
(without replacement within a draw, with replacement across draws), and yields each one as a record carrying its
own reward columns. TRL's GRPOTrainer then samples NUM_GENERATIONS completions per record. train_grpo.py makes one
draw cover one generation batch on every process (GRADIENT_ACCUMULATION_STEPS x number of processes micro-steps, x
GENERATION_STEPS when one batch feeds several optimizer steps), so no prompt is trained twice in one optimizer step
and, on several GPUs, each process gets different prompts.

Who makes the NUM_GENERATIONS copies: TRL 1.16 wraps an `IterableDataset` train set in
`trl.trainer.utils.repeat_iterable_dataset`, which repeats each record `num_generations` times in a row (the
streaming twin of its RepeatSampler), so StepStream yields each drawn prompt once; a stream that repeated them
itself would be repeated again. On several processes, accelerate gives each process a contiguous slice of every
generation batch (`IterableDatasetShard`), i.e. whole groups of whole micro-steps. tests/test_step_stream.py checks,
through GRPOTrainer's real train dataloader, that each prompt then arrives exactly NUM_GENERATIONS times in a row,
PROMPTS_PER_STEP distinct ones per micro-step, with its own rewards beside it; tests/test_distributed.py checks the
split between two processes.

Seeded and restartable: the same (rows, prompts_per_step, seed) give the same stream, so when a resumed run
skips the batches it already trained on, it sees the prompts the uninterrupted run would have seen.
"""

from __future__ import annotations

import itertools
import sys
from collections.abc import Iterator, Sequence

import numpy as np

from tes_grpo.run.presets import presets_for


class StepStream:
    """Endless seeded stream of training records, PROMPTS_PER_STEP distinct prompts per micro-step.

    rows: the training rows as dicts (or a pandas DataFrame), each with at least `prompt` and the reward
    columns; `columns` picks which keys each record carries (default: all of the first row's).
    steps_per_draw: micro-steps whose prompts are drawn together, all distinct (1 = each micro-step on its own).
    """

    def __init__(self, rows, prompts_per_step: int, seed: int, columns: Sequence[str] | None = None,
                 steps_per_draw: int = 1):
        if hasattr(rows, "to_dict"):
            rows = rows.to_dict(orient="records")
        rows = list(rows)
        if not rows:
            raise ValueError("StepStream needs at least one training row")
        if prompts_per_step < 1:
            raise ValueError(f"prompts_per_step must be at least 1, got {prompts_per_step}")
        if steps_per_draw < 1:
            raise ValueError(f"steps_per_draw must be at least 1, got {steps_per_draw}")
        if prompts_per_step * steps_per_draw > len(rows):
            raise ValueError(f"{prompts_per_step * steps_per_draw} distinct prompts per draw (prompts_per_step="
                             f"{prompts_per_step} x steps_per_draw={steps_per_draw}) need at least that many training "
                             f"rows; there are {len(rows)}")
        self.columns = list(columns) if columns is not None else list(rows[0])
        missing = [c for c in self.columns if c not in rows[0]]
        if missing:
            raise ValueError(f"rows lack column(s) {', '.join(missing)}")
        self.rows = [{c: row[c] for c in self.columns} for row in rows]
        self.prompts_per_step = prompts_per_step
        self.steps_per_draw = steps_per_draw
        self.seed = seed

    def micro_steps(self) -> Iterator[list[dict]]:
        """Endless: for each micro-step, a list of PROMPTS_PER_STEP rows (fresh dicts), distinct within a draw."""
        rng = np.random.default_rng(self.seed)
        per_step = self.prompts_per_step
        while True:
            picks = rng.choice(len(self.rows), size=per_step * self.steps_per_draw, replace=False)
            for start in range(0, len(picks), per_step):
                yield [dict(self.rows[i]) for i in picks[start:start + per_step]]

    def __iter__(self) -> Iterator[dict]:
        for group in self.micro_steps():
            yield from group

    def take(self, count: int) -> list[dict]:
        """The first `count` records of the stream."""
        return list(itertools.islice(iter(self), count))

    def to_iterable_dataset(self):
        """The stream as a `datasets.IterableDataset` (the only kind of stream TRL's GRPOTrainer accepts)."""
        from datasets import IterableDataset

        return IterableDataset.from_generator(stream_records, gen_kwargs={"stream": self})


def stream_records(stream: StepStream) -> Iterator[dict]:
    """Generator handed to `datasets.IterableDataset.from_generator` (module level so datasets can pickle it)."""
    yield from stream


STEPS = 3  # optimizer steps to print
MODEL_ID = "openai/gpt-oss-20b"  # as train_grpo.py; "tiny" applies the tiny run's preset to the settings below
DATA_DIR = "data"  # as train_grpo.py: every *_harmony.csv below it, EVAL_DIR left out
EVAL_DIR = "data/eval"  # evaluation split, never trained on
PROMPTS_PER_STEP = 1  # as train_grpo.py
NUM_GENERATIONS = 16  # as train_grpo.py: completions TRL samples from each prompt (said in the preview's first line)
GRADIENT_ACCUMULATION_STEPS = 4  # as train_grpo.py: micro-steps whose prompts are drawn together
GENERATION_STEPS = 1  # as train_grpo.py: optimizer steps one generation batch feeds (their prompts drawn together)
SEED = 42  # as train_grpo.py

# the settings above that MODEL_ID=tiny replaces, from train_grpo.py's table (tes_grpo/run/presets.py)
PRESETS = presets_for(globals())


def preview(settings) -> list[str]:
    """What one optimizer step holds, then one line per micro-step of the first STEPS optimizer steps: which rows
    (file:row) and optimal actions. With GENERATION_STEPS=k the prompts of k steps are drawn together and TRL
    shuffles their completions across those steps: a line's step is the step its prompt was drawn for."""
    from data_reward import load_training_frames

    frame = load_training_frames(settings.DATA_DIR, settings.EVAL_DIR)
    stream = StepStream(frame, settings.PROMPTS_PER_STEP, seed=settings.SEED, columns=["source", "optimal_action"],
                        steps_per_draw=settings.GRADIENT_ACCUMULATION_STEPS * settings.GENERATION_STEPS)
    micro = stream.micro_steps()
    together = (f"; {settings.GENERATION_STEPS} steps' prompts drawn together (one generation batch), their "
                "completions shuffled across those steps" if settings.GENERATION_STEPS > 1 else "")
    lines = [f"MODEL_ID={settings.MODEL_ID}: {settings.GRADIENT_ACCUMULATION_STEPS} micro-step(s) per optimizer step, "
             f"{settings.PROMPTS_PER_STEP} prompt(s) each, {settings.NUM_GENERATIONS} completions sampled per prompt "
             f"(SEED={settings.SEED}){together}"]
    for step in range(1, settings.STEPS + 1):
        for slot in range(settings.GRADIENT_ACCUMULATION_STEPS):
            rows = next(micro)
            lines.append(f"step {step} micro-step {slot}: " + ", ".join(
                f"{row['source']} (optimal {row['optimal_action']})" for row in rows))
    return lines


def main(argv: list[str] | None = None) -> int:
    from tes_grpo.run.fileio import InputError
    from tes_grpo.run.script_config import resolve

    settings = resolve(globals(), argv, presets=PRESETS)
    if settings.STEPS < 1:
        print(f"error: STEPS={settings.STEPS}: must be at least 1 (optimizer steps to print)", file=sys.stderr)
        return 2
    try:
        print("\n".join(preview(settings)))
    except (InputError, ValueError) as err:
        print(f"error: {err}", file=sys.stderr)
        return 1
    return 0


__all__ = ["StepStream", "stream_records"]


if __name__ == "__main__":
    sys.exit(main())
