"""The corrections every GRPO run needs: `quiet_library_warnings` before the trainer is built, `install` on it after
(training/trainer.py calls both); the speed choices are training/fast_paths.py's."""

from __future__ import annotations

from tes_grpo.patches import accelerate_patches, transformers_patches, trl_patches


def quiet_library_warnings() -> None:
    """Before the trainer is built (TRL warns from its constructor on): the library warnings a user cannot act on."""
    trl_patches.quiet_all_rewards_none_warning()
    transformers_patches.quiet_gradient_checkpointing_deprecation()


def install(trainer, tensorboard_dir, resume_step: int | None = None) -> list[str]:
    """The corrections every GRPO run needs on `trainer` (its model LoRA-wrapped): TensorBoard's events in
    tensorboard_dir, without the redone steps' old points after a resume from resume_step; storage for FSDP's
    trainable weights left on the meta device. Returns what the log prints. The speed choices are
    training/fast_paths.py's."""
    transformers_patches.point_tensorboard(trainer, tensorboard_dir, resume_step)
    moved = accelerate_patches.give_trainable_weights_storage(trainer.model)
    return [f"FSDP: {moved} trainable parameter(s) left on the meta device given storage"] if moved else []
