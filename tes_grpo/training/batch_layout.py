"""How one optimizer step's completions are generated and split into forward/backward passes: the batch layout.

Library module, not a script. train_grpo.py turns its settings (PROMPTS_PER_STEP, NUM_GENERATIONS,
GRADIENT_ACCUMULATION_STEPS, TRAIN_BATCH_SIZE, TRAIN_TOKENS_PER_PASS, GENERATION_STEPS) and the longest prompt into
the sizes GRPOConfig takes (`batch_layout`), with or without a memory plan (memory_plan.plan_run, on a GPU); the
layout itself needs no memory figure, so it runs anywhere.
"""

from __future__ import annotations

from tes_grpo.run.script_config import SettingsError


def largest_divisor_at_most(total: int, cap: int) -> int:
    return max(d for d in range(1, total + 1) if total % d == 0 and d <= max(1, cap))


def check_generation_cadence(s, steps_per_generation: int | None) -> None:
    """SettingsError when GENERATION_STEPS (optimizer steps) and the seed's GRPO_STEPS_PER_GENERATION
    (steps_per_generation, forward/backward passes) are both set: they set the same thing in two units."""
    if steps_per_generation is not None and s.GENERATION_STEPS != 1:
        raise SettingsError(f"GENERATION_STEPS={s.GENERATION_STEPS} and GRPO_STEPS_PER_GENERATION="
                            f"{steps_per_generation} both set how often completions are generated (optimizer steps / "
                            "forward-backward passes); unset the environment variable or leave GENERATION_STEPS at 1")


def generation_passes(s, passes: int, micro: int, steps_per_generation: int | None) -> int:
    """TRL's steps_per_generation: the forward/backward passes (of `micro` completions) one generation batch feeds.
    GENERATION_STEPS=k: k optimizer steps' `passes`. steps_per_generation (the seed's GRPO_STEPS_PER_GENERATION, in
    passes): that many, a divisor of one step's (check_generation_cadence: not both)."""
    check_generation_cadence(s, steps_per_generation)
    if steps_per_generation is None:
        return passes * s.GENERATION_STEPS
    if passes % steps_per_generation or (steps_per_generation * micro) % s.NUM_GENERATIONS:
        raise SettingsError(f"GRPO_STEPS_PER_GENERATION={steps_per_generation}: must divide the {passes} "
                            f"forward/backward passes of an optimizer step, and {steps_per_generation} x {micro} "
                            f"completions must be whole groups of NUM_GENERATIONS={s.NUM_GENERATIONS}")
    return steps_per_generation


def batch_layout(s, longest_prompt: int, steps_per_generation: int | None = None, plan=None) -> dict:
    """How one optimizer step's completions are generated and split into forward/backward passes.

    completions_per_step = PROMPTS_PER_STEP x NUM_GENERATIONS x GRADIENT_ACCUMULATION_STEPS. TRAIN_BATCH_SIZE=auto
    takes the largest divisor of it whose worst case (every completion at MAX_COMPLETION_LEN after the longest
    prompt) fits TRAIN_TOKENS_PER_PASS, so a longer MAX_COMPLETION_LEN trains in smaller passes, never out of
    memory, and the step still trains the same completions. A generation batch feeds GENERATION_STEPS optimizer
    steps (steps_per_generation = passes x GENERATION_STEPS, generation_batch = completions_per_step x
    GENERATION_STEPS), or, with steps_per_generation given (GRPO_STEPS_PER_GENERATION), that many passes
    (`generation_passes`). plan (memory_plan.plan_run, on a GPU): TRAIN_BATCH_SIZE=auto takes its completions a
    pass, and a generate call its sequences, which may split the generation batch.
    """
    per_step = s.PROMPTS_PER_STEP * s.NUM_GENERATIONS * s.GRADIENT_ACCUMULATION_STEPS
    sequence = longest_prompt + s.MAX_COMPLETION_LEN
    if str(s.TRAIN_BATCH_SIZE) == "auto":
        cap = s.TRAIN_TOKENS_PER_PASS // sequence
        micro = plan.train_batch_size if plan else largest_divisor_at_most(per_step, cap)
    else:
        micro = int(s.TRAIN_BATCH_SIZE)
    if per_step % micro:
        raise SettingsError(f"TRAIN_BATCH_SIZE={micro} must divide the {per_step} completions of an optimizer step "
                            "(PROMPTS_PER_STEP x NUM_GENERATIONS x GRADIENT_ACCUMULATION_STEPS)")
    passes = per_step // micro
    generation = generation_passes(s, passes, micro, steps_per_generation)
    return {"completions_per_step": per_step, "prompts_per_step": per_step // s.NUM_GENERATIONS,
            "train_batch_size": micro, "gradient_accumulation_steps": passes, "steps_per_generation": generation,
            "generation_steps": s.GENERATION_STEPS if steps_per_generation is None else 1,
            "generation_batch": generation * micro,
            "generation_sequences": plan.generation_sequences if plan else generation * micro,
            "worst_case_tokens_per_pass": micro * sequence, "longest_prompt": longest_prompt}

