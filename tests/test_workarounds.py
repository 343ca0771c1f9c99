"""tes_grpo/workarounds.py: TensorBoard after a resume keeps one point per step (issue 14), without a model."""

from __future__ import annotations

from types import SimpleNamespace

import pytest


def tensorboard_steps(log_dir) -> list[int]:
    """The steps of train/reward's points, sorted (two event files written in the same second load in either
    order)."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    events = EventAccumulator(str(log_dir), purge_orphaned_data=True)
    events.Reload()
    return sorted(event.step for event in events.Scalars("train/reward"))


def fake_trainer(log_dir):
    from transformers.integrations import TensorBoardCallback

    callback = TensorBoardCallback()
    return SimpleNamespace(callback_handler=SimpleNamespace(callbacks=[callback]), is_world_process_zero=lambda: True,
                           callback=callback)


def log_steps(trainer, steps) -> None:
    state = SimpleNamespace(is_world_process_zero=True, is_hyper_param_search=False, global_step=0)
    args = SimpleNamespace(output_dir="unused", to_json_string=lambda: "{}")
    trainer.callback.on_train_begin(args, state, None)
    for step in steps:
        state.global_step = step
        trainer.callback.on_log(args, state, None, logs={"reward": 0.1 * step})
    trainer.callback.tb_writer.close()


# (steps of the first run, checkpoint step resumed from, steps of the resumed run)
RESUMES = [
    (range(1, 21), 10, range(11, 13)),  # killed after step 20, resumed from 10 to 12: 13..20 must disappear
    (range(1, 6), 5, range(6, 9)),  # resumed from the last step: nothing redone
]


@pytest.mark.parametrize("first, checkpoint, resumed", RESUMES)
def test_resumed_run_leaves_one_tensorboard_point_per_step(tmp_path, first, checkpoint, resumed):
    from tes_grpo.workarounds import point_tensorboard

    log_dir = tmp_path / "tensorboard"
    trainer = fake_trainer(log_dir)
    assert point_tensorboard(trainer, log_dir)
    log_steps(trainer, first)
    again = fake_trainer(log_dir)
    assert point_tensorboard(again, log_dir, resume_step=checkpoint)
    log_steps(again, resumed)
    assert tensorboard_steps(log_dir) == list(range(1, checkpoint + 1)) + list(resumed)


def test_without_purge_step_the_redone_steps_are_doubled(tmp_path):
    # what transformers does by itself (the behaviour the workaround exists for)
    from tes_grpo.workarounds import point_tensorboard

    log_dir = tmp_path / "tensorboard"
    for steps in (range(1, 5), range(3, 5)):
        trainer = fake_trainer(log_dir)
        point_tensorboard(trainer, log_dir)
        log_steps(trainer, steps)
    assert tensorboard_steps(log_dir) == [1, 2, 3, 3, 4, 4]
