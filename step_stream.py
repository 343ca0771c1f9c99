"""StepStream: the endless, seeded stream of training prompts that GRPO reads (not a script).

For every micro-step it draws PROMPTS_PER_STEP distinct prompts at random (without replacement within the
micro-step, with replacement across micro-steps) and yields each one as a record carrying its own reward
columns. TRL's GRPOTrainer then samples NUM_GENERATIONS completions per record.

Who makes the NUM_GENERATIONS copies: TRL 1.16 wraps an `IterableDataset` train set in
`trl.trainer.utils.repeat_iterable_dataset`, which repeats each record `num_generations` times in a row (the
streaming twin of its RepeatSampler), so StepStream yields each drawn prompt once; a stream that repeated them
itself would be repeated again. tests/test_step_stream.py checks, through GRPOTrainer's real train dataloader,
that each prompt then arrives exactly NUM_GENERATIONS times in a row, PROMPTS_PER_STEP distinct ones per
micro-step, with its own rewards beside it.

Seeded and restartable: the same (rows, prompts_per_step, seed) give the same stream, so when a resumed run
skips the batches it already trained on, it sees the prompts the uninterrupted run would have seen.
"""

from __future__ import annotations

import itertools
from collections.abc import Iterator, Sequence

import numpy as np


class StepStream:
    """Endless seeded stream of training records, PROMPTS_PER_STEP distinct prompts per micro-step.

    rows: the training rows as dicts (or a pandas DataFrame), each with at least `prompt` and the reward
    columns; `columns` picks which keys each record carries (default: all of the first row's).
    """

    def __init__(self, rows, prompts_per_step: int, seed: int, columns: Sequence[str] | None = None):
        if hasattr(rows, "to_dict"):
            rows = rows.to_dict(orient="records")
        rows = list(rows)
        if not rows:
            raise ValueError("StepStream needs at least one training row")
        if prompts_per_step < 1:
            raise ValueError(f"prompts_per_step must be at least 1, got {prompts_per_step}")
        if prompts_per_step > len(rows):
            raise ValueError(f"prompts_per_step={prompts_per_step} distinct prompts per micro-step need at least "
                             f"that many training rows; there are {len(rows)}")
        self.columns = list(columns) if columns is not None else list(rows[0])
        missing = [c for c in self.columns if c not in rows[0]]
        if missing:
            raise ValueError(f"rows lack column(s) {', '.join(missing)}")
        self.rows = [{c: row[c] for c in self.columns} for row in rows]
        self.prompts_per_step = prompts_per_step
        self.seed = seed

    def micro_steps(self) -> Iterator[list[dict]]:
        """Endless: for each micro-step, a list of PROMPTS_PER_STEP distinct rows (as fresh dicts)."""
        rng = np.random.default_rng(self.seed)
        while True:
            picks = rng.choice(len(self.rows), size=self.prompts_per_step, replace=False)
            yield [dict(self.rows[i]) for i in picks]

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


__all__ = ["StepStream", "stream_records"]
