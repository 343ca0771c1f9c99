"""The settings presets train_grpo.py and step_stream.py share: `--MODEL_ID=tiny` replaces their defaults.

    .venv/bin/python train_grpo.py --MODEL_ID=tiny     # trains with TINY_RUN's values
    .venv/bin/python step_stream.py --MODEL_ID=tiny    # previews that run's prompt stream

A script passes `presets_for(its settings)` to script_config.resolve, which applies a preset to every setting not
given on the command line, prints what it replaced at start and lists it under --help. step_stream.py has only the
stream's settings (GRADIENT_ACCUMULATION_STEPS, NUM_GENERATIONS, ...), so it gets that part of the same table, and
its preview shows the stream train_grpo.py will draw.

What the tiny run's values are for: a run on the embedded tiny gpt-oss (tiny_model.py) that finishes in a few
minutes on a 2-core CPU and still shows GRPO learning: fewer, shorter completions and steps; a higher, constant
learning rate and rank 16 because the tiny model has to move within 30 steps; no gradient checkpointing because
memory is no issue; no KL term, as INVALID_REWARD=0 keeps the answer format. BENCHMARKS.md ("The tiny run's preset")
has the runs behind these choices. Its evaluation (run/evaluation.py) runs at steps 0, 10, 20 and 30 (EVAL_STEPS=auto
follows SAVE_STEPS) on 64 prompts of the split x 1 completion (4 generate calls of 16, about 11 s on 2 cores): the
spread between prompts, not within one, makes most of the noise.
"""

from __future__ import annotations

TINY_MODEL_ID = "tiny"  # MODEL_ID that builds and uses the embedded tiny gpt-oss (model_loading.resolve_model_path)

TINY_RUN = {
    "OUT_DIR": "runs/grpo-tiny", "NUM_GENERATIONS": 8, "GRADIENT_ACCUMULATION_STEPS": 2, "MAX_COMPLETION_LEN": 48,
    "TOTAL_STEPS": 30, "SAVE_STEPS": 10, "LR": 2e-3, "LR_SCHEDULER": "constant", "LORA_R": 16, "LORA_ALPHA": 32,
    "GRADIENT_CHECKPOINTING": False, "EVAL_PROMPTS": 64, "EVAL_SAMPLES": 1,
}

TRAINING_PRESETS = {"MODEL_ID": {TINY_MODEL_ID: TINY_RUN}}  # {setting: {its value: {setting: preset value}}}


def presets_for(names) -> dict:
    """TRAINING_PRESETS restricted to the settings `names` a script has (script_config.resolve's presets)."""
    names = set(names)
    return {key: {value: {name: preset for name, preset in values.items() if name in names}
                  for value, values in by_value.items()}
            for key, by_value in TRAINING_PRESETS.items() if key in names}
