"""StepStream on its own, and as TRL 1.16's GRPOTrainer actually reads it."""

from __future__ import annotations

import itertools

import pytest

from step_stream import StepStream
from tes_grpo.training.batch_layout import batch_layout

ROWS = [{"prompt": f"prompt {i}", "reward_action_0": i / 10, "reward_action_1": 1 - i / 10, "optimal_action": i % 4}
        for i in range(7)]


def test_same_seed_same_stream_other_seed_other_stream():
    assert StepStream(ROWS, 2, seed=3).take(40) == StepStream(ROWS, 2, seed=3).take(40)
    assert StepStream(ROWS, 2, seed=3).take(40) != StepStream(ROWS, 2, seed=4).take(40)


@pytest.mark.parametrize("prompts_per_step", [1, 3, 7])
def test_each_micro_step_has_distinct_prompts(prompts_per_step):
    groups = list(itertools.islice(StepStream(ROWS, prompts_per_step, seed=0).micro_steps(), 50))
    assert all(len({row["prompt"] for row in group}) == prompts_per_step for group in groups)


@pytest.mark.parametrize("prompts_per_step, steps_per_draw", [(1, 7), (2, 3), (3, 2)])
def test_a_draw_spans_several_micro_steps_with_distinct_prompts(prompts_per_step, steps_per_draw):
    groups = list(itertools.islice(StepStream(ROWS, prompts_per_step, seed=0, steps_per_draw=steps_per_draw)
                                   .micro_steps(), 10 * steps_per_draw))
    assert all(len(group) == prompts_per_step for group in groups)
    for start in range(0, len(groups), steps_per_draw):
        drawn = [row["prompt"] for group in groups[start:start + steps_per_draw] for row in group]
        assert len(set(drawn)) == prompts_per_step * steps_per_draw


def test_endless_and_covers_every_row():
    records = StepStream(ROWS, 2, seed=1).take(5000)
    assert len(records) == 5000
    assert {r["prompt"] for r in records} == {r["prompt"] for r in ROWS}


def test_rewards_stay_with_their_prompt():
    by_prompt = {r["prompt"]: r for r in ROWS}
    assert all(record == by_prompt[record["prompt"]] for record in StepStream(ROWS, 3, seed=2).take(300))


def test_columns_selects_keys_and_records_are_copies():
    stream = StepStream(ROWS, 1, seed=0, columns=["prompt", "reward_action_0"])
    first = stream.take(1)[0]
    assert set(first) == {"prompt", "reward_action_0"}
    first["prompt"] = "changed"
    assert all(r["prompt"] != "changed" for r in stream.rows)


# (rows, prompts_per_step, columns, error text)
BAD = [
    ([], 1, None, "at least one training row"),
    (ROWS, 0, None, "at least 1"),
    (ROWS, 8, None, "there are 7"),
    (ROWS, 1, ["prompt", "missing"], "missing"),
]


@pytest.mark.parametrize("rows, prompts_per_step, columns, text", BAD)
def test_bad_arguments(rows, prompts_per_step, columns, text):
    with pytest.raises(ValueError, match=text):
        StepStream(rows, prompts_per_step, seed=0, columns=columns)


# (prompts_per_step, steps_per_draw, error text)
BAD_DRAWS = [
    (1, 0, "steps_per_draw must be at least 1"),
    (2, 4, "8 distinct prompts per draw"),  # 8 > 7 rows
]


@pytest.mark.parametrize("prompts_per_step, steps_per_draw, text", BAD_DRAWS)
def test_bad_draws(prompts_per_step, steps_per_draw, text):
    with pytest.raises(ValueError, match=text):
        StepStream(ROWS, prompts_per_step, seed=0, steps_per_draw=steps_per_draw)


def test_train_grpo_draws_one_optimizer_step_on_every_process_at_once():
    import train_grpo

    rows = [{**r, "reward_action_2": 0.0, "reward_action_3": 0.0} for r in ROWS]
    settings = train_grpo.default_settings(PROMPTS_PER_STEP=1, GRADIENT_ACCUMULATION_STEPS=3)
    assert train_grpo.build_stream(rows, settings, processes=2).steps_per_draw == 6
    with pytest.raises(train_grpo.SettingsError, match="9 distinct prompts per draw.*3 process"):
        train_grpo.build_stream(rows, settings, processes=3)  # 9 distinct prompts per optimizer step, 7 rows


def test_accepts_a_dataframe():
    import pandas as pd

    assert StepStream(pd.DataFrame(ROWS), 2, seed=5).take(10) == StepStream(ROWS, 2, seed=5).take(10)


def test_grpo_trainer_sees_each_prompt_num_generations_times_with_its_rewards(tmp_path):
    """Through train_grpo's own GRPOConfig and TRL's real train dataloader (no generation)."""
    from transformers import GptOssForCausalLM
    from trl import GRPOTrainer

    import train_grpo
    from data_reward import reward_fn
    from tes_grpo.model.tiny_model import current_settings, tiny_config
    from tes_grpo.task.harmony import load_tokenizer

    tokenizer = load_tokenizer()
    model = GptOssForCausalLM(tiny_config(len(tokenizer), {**current_settings(), "NUM_LAYERS": 1}))
    settings = train_grpo.default_settings(OUT_DIR=str(tmp_path / "run"), PROMPTS_PER_STEP=2, NUM_GENERATIONS=3,
                                           GRADIENT_ACCUMULATION_STEPS=2, TOTAL_STEPS=3, TRAIN_BATCH_SIZE="6")
    rows = [{**r, "reward_action_2": 0.0, "reward_action_3": 0.0} for r in ROWS]
    stream = train_grpo.build_stream(rows, settings, processes=1)
    args = train_grpo.build_grpo_config(settings, batch_layout(settings, 100), cuda=False)
    trainer = GRPOTrainer(model=model, reward_funcs=reward_fn, args=args, train_dataset=stream.to_iterable_dataset(),
                          processing_class=tokenizer)
    per_device, spg, group = args.per_device_train_batch_size, args.steps_per_generation, 3
    assert (per_device, spg) == (6, 2)

    batches = list(itertools.islice(trainer.get_train_dataloader(), 3 * spg))
    expected_groups = list(itertools.islice(stream.micro_steps(), 3 * spg))
    by_prompt = {r["prompt"]: r for r in rows}
    for generation in range(3):
        # TRL hands the same generation batch to each of its steps_per_generation micro-steps (it generates once)
        first = batches[generation * spg]
        assert all(batch == first for batch in batches[generation * spg:(generation + 1) * spg])
        assert len(first) == per_device * spg
        for slot in range(spg):
            micro = first[slot * per_device:(slot + 1) * per_device]
            prompts = [record["prompt"] for record in micro]
            # NUM_GENERATIONS copies in a row, PROMPTS_PER_STEP distinct prompts, in StepStream's order
            assert prompts == [row["prompt"] for row in expected_groups[generation * spg + slot] for _ in range(group)]
            assert all(record == by_prompt[record["prompt"]] for record in micro)


def test_preview_prints_each_micro_step_of_the_first_steps(capsys):
    import step_stream

    assert step_stream.main(["--STEPS=2", "--GRADIENT_ACCUMULATION_STEPS=3"]) == 0
    header, *lines = capsys.readouterr().out.splitlines()
    assert header.startswith("MODEL_ID=openai/gpt-oss-20b: 3 micro-step(s) per optimizer step, 1 prompt(s) each, "
                             "16 completions sampled per prompt")
    assert [line.split(":")[0] for line in lines] == [f"step {s} micro-step {m}" for s in (1, 2) for m in range(3)]
    sources = [line.split(": ", 1)[1] for line in lines[:3]]
    assert len(set(sources)) == 3  # the prompts of one optimizer step are distinct


def test_tiny_preview_is_the_tiny_runs_stream(capsys):
    """--MODEL_ID=tiny takes train_grpo's tiny preset: its micro-steps per step and generations, and its prompts."""
    import step_stream
    import train_grpo

    assert step_stream.main(["--MODEL_ID=tiny", "--STEPS=2"]) == 0
    header, *lines = capsys.readouterr().out.splitlines()
    tiny = train_grpo.default_settings(MODEL_ID="tiny")
    assert header.startswith(f"MODEL_ID=tiny: {tiny.GRADIENT_ACCUMULATION_STEPS} micro-step(s) per optimizer step, "
                             f"{tiny.PROMPTS_PER_STEP} prompt(s) each, {tiny.NUM_GENERATIONS} completions")
    assert [line.split(":")[0] for line in lines] == [
        f"step {s} micro-step {m}" for s in (1, 2) for m in range(tiny.GRADIENT_ACCUMULATION_STEPS)]
    # the same draws as train_grpo's stream for the tiny run on one process
    from data_reward import load_training_frames

    frame = load_training_frames(tiny.DATA_DIR, tiny.EVAL_DIR)
    source_of = dict(zip(frame["prompt"], frame["source"], strict=True))
    stream = train_grpo.build_stream(frame, tiny, processes=1).micro_steps()
    drawn = [source_of[row["prompt"]] for _ in range(len(lines)) for row in next(stream)]
    assert [line.split(": ", 1)[1].split(" (optimal")[0] for line in lines] == drawn


def test_preview_with_generation_steps_is_the_runs_stream(capsys):
    """GENERATION_STEPS=2: the preview draws 2 steps' prompts together, all distinct, as train_grpo's stream does."""
    import step_stream
    import train_grpo
    from data_reward import load_training_frames

    assert step_stream.main(["--STEPS=2", "--GRADIENT_ACCUMULATION_STEPS=2", "--GENERATION_STEPS=2"]) == 0
    header, *lines = capsys.readouterr().out.splitlines()
    assert "2 steps' prompts drawn together" in header
    settings = train_grpo.default_settings(GRADIENT_ACCUMULATION_STEPS=2, GENERATION_STEPS=2)
    frame = load_training_frames(settings.DATA_DIR, settings.EVAL_DIR)
    source_of = dict(zip(frame["prompt"], frame["source"], strict=True))
    stream = train_grpo.build_stream(frame, settings, processes=1).micro_steps()
    drawn = [source_of[row["prompt"]] for _ in range(len(lines)) for row in next(stream)]
    shown = [line.split(": ", 1)[1].split(" (optimal")[0] for line in lines]
    assert shown == drawn and len(set(shown)) == 4  # one draw of 4 distinct prompts for steps 1 and 2


def test_step_stream_and_train_grpo_share_one_preset_table():
    import step_stream
    import train_grpo
    from tes_grpo.run import presets

    assert train_grpo.PRESETS == presets.TRAINING_PRESETS  # every preset name is a train_grpo setting
    tiny_stream = step_stream.PRESETS["MODEL_ID"]["tiny"]
    assert set(tiny_stream) == set(presets.TINY_RUN) & set(vars(step_stream))
    assert {"NUM_GENERATIONS", "GRADIENT_ACCUMULATION_STEPS"} <= set(tiny_stream)
    assert all(tiny_stream[name] == train_grpo.PRESETS["MODEL_ID"]["tiny"][name] for name in tiny_stream)
    for name in ("PROMPTS_PER_STEP", "NUM_GENERATIONS", "GRADIENT_ACCUMULATION_STEPS", "SEED", "DATA_DIR", "EVAL_DIR",
                 "MODEL_ID"):
        assert getattr(step_stream, name) == getattr(train_grpo, name), name  # the untouched defaults agree too


@pytest.mark.parametrize("steps", [0, -1])
def test_preview_of_no_steps_is_an_error(capsys, steps):
    import step_stream

    assert step_stream.main([f"--STEPS={steps}"]) == 2
    assert capsys.readouterr().err.startswith(f"error: STEPS={steps}: must be at least 1")
