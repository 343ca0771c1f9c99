"""train_grpo.py: settings, wiring, the tiny MXFP4 checkpoint, and one real end-to-end GRPO run on CPU.

The end-to-end run (module fixture `run`, ~2 min on 2 cores) trains the embedded tiny gpt-oss for 20 steps on
fixture prompts with prompt-specific rewards through `train_grpo.main`, then resumes from its step-10 checkpoint
to step 12; the tests below read what it left behind.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pandas as pd
import pytest
import torch
from transformers import TrainerCallback

import train_grpo
from data_reward import LOG_COLUMNS
from tes_grpo.fileio import InputError
from grpo_fixtures import rewards_by_prompt, write_fixture_data

FIRST_STEPS, SAVE_STEPS, RESUMED_TO = 20, 10, 12


# ---------------------------------------------------------------------------------------------------------------
# Settings and wiring (no training)
# ---------------------------------------------------------------------------------------------------------------

# (overrides, completions per optimizer step, prompts per step, per-pass batch, accumulation steps)
LAYOUTS = [
    ({}, 64, 4, 16, 4),  # the 20B defaults: 1 prompt x 16 generations x 4 micro-steps
    ({"TRAIN_BATCH_SIZE": 8}, 64, 4, 8, 8),  # smaller passes, same 64 completions per step
    ({"PROMPTS_PER_STEP": 2, "NUM_GENERATIONS": 8, "GRADIENT_ACCUMULATION_STEPS": 2}, 32, 4, 16, 2),
    ({"NUM_GENERATIONS": 8, "GRADIENT_ACCUMULATION_STEPS": 1}, 8, 1, 8, 1),
]


@pytest.mark.parametrize("overrides, per_step, prompts, micro, accumulation", LAYOUTS)
def test_batch_layout(overrides, per_step, prompts, micro, accumulation):
    layout = train_grpo.batch_layout(train_grpo.default_settings(**overrides))
    assert layout == {"completions_per_step": per_step, "prompts_per_step": prompts, "train_batch_size": micro,
                      "gradient_accumulation_steps": accumulation}


# (overrides, words of the SettingsError)
BAD_SETTINGS = [
    ({"NUM_GENERATIONS": 1}, "at least 2"),
    ({"TRAIN_BATCH_SIZE": 24}, "must divide the 64"),
    ({"LORA_EXPERT_LAYERS": ["seven"]}, "not a layer number"),
    ({"PROMPT_TOO_LONG": "cut"}, "'error' or 'skip'"),
    ({"SCALE_REWARDS": "std"}, "none, group or batch"),
    ({"REASONING_EFFORT": "max"}, "low, medium, high"),
    ({"DECODE_EXPERTS": "fast"}, "auto, grouped_mm or transformers"),
    ({"MAX_COMPLETION_LEN": 0}, "MAX_COMPLETION_LEN must be at least 1"),
]


@pytest.mark.parametrize("overrides, words", BAD_SETTINGS)
def test_bad_settings(overrides, words):
    with pytest.raises(train_grpo.SettingsError, match=words):
        train_grpo.check_settings(train_grpo.default_settings(**overrides))


def test_default_settings_rejects_unknown_names():
    with pytest.raises(KeyError, match="NUM_GENERATION"):
        train_grpo.default_settings(NUM_GENERATION=4)


def test_tiny_defaults_apply_only_to_tiny_and_not_over_explicit_values(capsys):
    big = train_grpo.default_settings()
    assert train_grpo.apply_tiny_defaults(big, set()) == big
    tiny = train_grpo.apply_tiny_defaults(train_grpo.default_settings(MODEL_ID="tiny", TOTAL_STEPS=7), {"TOTAL_STEPS"})
    assert tiny["TOTAL_STEPS"] == 7 and tiny["NUM_GENERATIONS"] == train_grpo.TINY_DEFAULTS["NUM_GENERATIONS"]
    assert "MODEL_ID=tiny: tiny defaults" in capsys.readouterr().out


def test_grpo_config_uses_cache_stream_options_and_loss(tmp_path):
    settings = train_grpo.default_settings(OUT=str(tmp_path))
    args = train_grpo.build_grpo_config(settings, cuda=False)
    assert args.generation_kwargs == {"use_cache": True}  # generation keeps its KV cache under checkpointing
    assert args.shuffle_dataset is False and args.max_steps == settings["TOTAL_STEPS"]
    assert (args.per_device_train_batch_size, args.gradient_accumulation_steps, args.steps_per_generation) == (16, 4, 4)
    assert args.generation_batch_size == 64 and args.num_generations == 16
    assert args.loss_type == "dr_grpo" and args.scale_rewards == "none" and args.beta == 0.0
    assert args.max_completion_length == 512 and args.gradient_checkpointing is True
    assert args.bf16 is False  # float32 on CPU (bf16=True is asked for on CUDA only)


@pytest.mark.parametrize("cuda, expected", [(True, "flex_attention"), (False, "eager")])
def test_attention_and_dtype_by_device(cuda, expected):
    assert train_grpo.attention_implementation("auto", cuda=cuda) == expected
    assert train_grpo.attention_implementation("sdpa", cuda=cuda) == "sdpa"
    assert train_grpo.model_dtype(cuda) == (torch.bfloat16 if cuda else torch.float32)


@pytest.mark.parametrize("layers, expected", [
    ((), None),  # attention only
    ((7, 15), ["layers.7.mlp.experts.gate_up_proj", "layers.7.mlp.experts.down_proj",
               "layers.15.mlp.experts.gate_up_proj", "layers.15.mlp.experts.down_proj"]),
])
def test_lora_config(layers, expected):
    config = train_grpo.build_lora_config(16, 32, layers)
    assert config.target_modules == "all-linear" and config.lora_dropout == 0.0
    assert (sorted(config.target_parameters) if config.target_parameters else None) == (
        sorted(expected) if expected else None)


def make_checkpoint(out: Path, step: int, padded: bool = True) -> Path:
    folder = out / (f"checkpoint-{step:06d}" if padded else f"checkpoint-{step}")
    folder.mkdir(parents=True)
    (folder / "trainer_state.json").write_text(json.dumps({"global_step": step}))
    return folder


def test_resume_picks_newest_checkpoint_by_number(tmp_path):
    for step, padded in ((5, True), (20, False), (10, True)):
        make_checkpoint(tmp_path, step, padded)
    settings = train_grpo.default_settings(OUT=str(tmp_path), RESUME="1")
    assert train_grpo.resume_checkpoint(settings) == tmp_path / "checkpoint-20"
    explicit = train_grpo.default_settings(OUT=str(tmp_path), RESUME=str(tmp_path / "checkpoint-000005"))
    assert train_grpo.resume_checkpoint(explicit) == tmp_path / "checkpoint-000005"


# (what OUT holds, RESUME, error words or None)
RESUME_CASES = [
    ([], "", None),  # new run in an empty folder
    (["checkpoint"], "", "--RESUME=1"),  # refuses to start over an existing run
    (["metrics.jsonl"], "", "already holds a run"),
    ([], "1", "no checkpoint-. folder"),
    ([], "/nonexistent/checkpoint-3", "without trainer_state.json"),
]


@pytest.mark.parametrize("contents, resume, words", RESUME_CASES)
def test_resume_rules(tmp_path, contents, resume, words):
    if "checkpoint" in contents:
        make_checkpoint(tmp_path, 4)
    if "metrics.jsonl" in contents:
        (tmp_path / "metrics.jsonl").write_text("{}\n")
    settings = train_grpo.default_settings(OUT=str(tmp_path), RESUME=resume)
    if words is None:
        assert train_grpo.resume_checkpoint(settings) is None
    else:
        with pytest.raises(InputError, match=words):
            train_grpo.resume_checkpoint(settings)


def test_drop_log_rows_after_checkpoint(tmp_path, capsys):
    (tmp_path / "metrics.jsonl").write_text("".join(json.dumps({"step": s, "reward": 0.1}) + "\n" for s in (1, 2, 3, 4)))
    log = tmp_path / "completions.csv"
    pd.DataFrame({"step": [1, 2, 3, 3, 4], "micro_step": 0, "prompt": "p\nq", "completion": "c", "action": "",
                  "reward": "", "target_action": 1}).to_csv(log, index=False)
    train_grpo.drop_log_rows_after(tmp_path, 2, log)
    assert [json.loads(x)["step"] for x in (tmp_path / "metrics.jsonl").read_text().splitlines()] == [1, 2]
    kept = pd.read_csv(log, keep_default_na=False)
    assert kept["step"].tolist() == [1, 2] and kept["prompt"].tolist() == ["p\nq", "p\nq"]
    assert "dropped 2 metrics line(s)" in capsys.readouterr().out


def test_zero_padded_checkpoint_rename(tmp_path):
    from types import SimpleNamespace

    make_checkpoint(tmp_path, 30, padded=False)
    state = SimpleNamespace(global_step=30, is_world_process_zero=True)
    train_grpo.ZeroPaddedCheckpointNames().on_save(SimpleNamespace(output_dir=str(tmp_path)), state, None)
    assert [p.name for p in tmp_path.iterdir()] == ["checkpoint-000030"]


def test_cpu_scoring_patch_is_idempotent():
    import trl.trainer.utils as trl_utils

    assert train_grpo.score_only_completion_tokens_on_cpu()
    patched = trl_utils._use_triton
    assert train_grpo.score_only_completion_tokens_on_cpu() and trl_utils._use_triton is patched
    assert patched(torch.device("cpu")) is True


# ---------------------------------------------------------------------------------------------------------------
# The tiny MXFP4 checkpoint
# ---------------------------------------------------------------------------------------------------------------

def test_tiny_checkpoint_is_in_the_real_mxfp4_layout():
    from safetensors import safe_open

    from tes_grpo.mxfp4 import fake_quantize_expert_param

    folder = Path(train_grpo.resolve_model_path("tiny"))
    config = json.loads((folder / "config.json").read_text())
    assert config["quantization_config"]["quant_method"] == "mxfp4" and config["model_type"] == "gpt_oss"
    assert config["vocab_size"] == 201088 and config["architectures"] == ["GptOssForCausalLM"]
    assert json.loads((folder / "generation_config.json").read_text())["eos_token_id"] == [200002, 199999, 200012]
    assert (folder / "tokenizer.json").is_file() and (folder / "chat_template.jinja").is_file()
    with safe_open(folder / "model.safetensors", "pt") as f:
        keys = set(f.keys())
        assert f.get_tensor("model.layers.0.mlp.experts.gate_up_proj_blocks").dtype == torch.uint8
    assert {"model.layers.1.mlp.experts.down_proj_blocks", "model.layers.1.mlp.experts.down_proj_scales"} <= keys
    assert not any(k.endswith(("experts.gate_up_proj", "experts.down_proj")) for k in keys)
    model = train_grpo.load_policy_model("tiny")  # through Mxfp4Config(dequantize=True), like the 20B
    experts = model.model.layers[0].mlp.experts.gate_up_proj.detach()
    assert model.dtype == torch.float32 and model.config._attn_implementation == "eager"
    assert torch.equal(fake_quantize_expert_param(experts).float(), experts)  # exactly on the MXFP4 grid


# ---------------------------------------------------------------------------------------------------------------
# Generation keeps its KV cache with gradient checkpointing on (the GPU default)
# ---------------------------------------------------------------------------------------------------------------

def test_generation_uses_kv_cache_with_gradient_checkpointing(tmp_path, tokenizer):
    data = write_fixture_data(tmp_path, tokenizer)
    settings = train_grpo.default_settings(
        MODEL_ID="tiny", DATA_DIR=str(data), EVAL_DIR=str(data / "eval"), OUT=str(tmp_path / "run"), TOTAL_STEPS=1,
        NUM_GENERATIONS=2, GRADIENT_ACCUMULATION_STEPS=1, MAX_COMPLETION_LEN=6, GRADIENT_CHECKPOINTING=True)
    model = train_grpo.load_policy_model("tiny")
    frame = train_grpo.load_training_data(settings, tokenizer)
    calls = []
    model.model.embed_tokens.register_forward_hook(
        lambda module, inputs, output: calls.append((inputs[0].shape[1], torch.is_grad_enabled())))
    trainer = train_grpo.build_trainer(settings, model, tokenizer, train_grpo.build_train_dataset(frame, settings),
                                       completion_log_path=str(tmp_path / "c.csv"))
    trainer.train()
    generation = [length for length, grad in calls if not grad]
    prompt_len = generation[0]
    assert prompt_len > 500 and 2 <= len(generation) <= 6
    assert generation[1:] == [1] * (len(generation) - 1)  # one new token per step: the cache holds the prefix
    assert any(grad and length > prompt_len for length, grad in calls)  # then the training forward
    assert trainer.model.base_model.model.is_gradient_checkpointing


# ---------------------------------------------------------------------------------------------------------------
# End to end: train_grpo.main on the tiny model, then resume
# ---------------------------------------------------------------------------------------------------------------

class WeightWatcher(TrainerCallback):
    """Copies the trainable (LoRA) and a sample of frozen (base) weights at train begin and end."""

    def __init__(self):
        self.snapshots = {}

    def snapshot(self, model):
        return {name: p.detach().clone() for name, p in model.named_parameters()
                if p.requires_grad or name.endswith(("q_proj.base_layer.weight", "experts.gate_up_proj", "lm_head.weight"))}

    def on_train_begin(self, args, state, control, model=None, **kwargs):
        self.snapshots["begin"] = self.snapshot(model)

    def on_train_end(self, args, state, control, model=None, **kwargs):
        self.snapshots["end"] = self.snapshot(model)


@pytest.fixture(scope="module")
def run(tmp_path_factory, tokenizer):
    root = tmp_path_factory.mktemp("e2e")
    data = write_fixture_data(root, tokenizer)
    out = root / "run"
    argv = ["--MODEL_ID=tiny", f"--DATA_DIR={data}", f"--EVAL_DIR={data / 'eval'}", f"--OUT={out}",
            "--NUM_GENERATIONS=16", "--GRADIENT_ACCUMULATION_STEPS=1", f"--SAVE_STEPS={SAVE_STEPS}"]
    watcher = WeightWatcher()
    with pytest.MonkeyPatch.context() as mp:
        mp.delenv("GRPO_COMPLETION_LOG_PATH", raising=False)
        mp.delenv("GRPO_LOG_COMPLETIONS", raising=False)
        assert train_grpo.main(argv + [f"--TOTAL_STEPS={FIRST_STEPS}"], callbacks=[watcher]) == 0
        first = {"completions": pd.read_csv(out / "completions.csv", keep_default_na=False),
                 "metrics": (out / "metrics.jsonl").read_text().splitlines(),
                 "checkpoints": sorted(p.name for p in out.glob("checkpoint-*")),
                 "adapter": root / "first_adapter.safetensors"}
        shutil.copy(out / "adapter_model.safetensors", first["adapter"])
        mp.delenv("GRPO_COMPLETION_LOG_PATH", raising=False)
        assert train_grpo.main(argv + [f"--TOTAL_STEPS={RESUMED_TO}",
                                       f"--RESUME={out / f'checkpoint-{SAVE_STEPS:06d}'}"]) == 0
    return {"out": out, "first": first, "watcher": watcher, "tokenizer": tokenizer}


def test_run_writes_adapter_checkpoints_config_and_logs(run):
    out, first = run["out"], run["first"]
    assert first["checkpoints"] == ["checkpoint-000010", "checkpoint-000020"]
    for name in ("adapter_model.safetensors", "adapter_config.json", "tokenizer.json", "trainer_state.json",
                 "train_config.json", "metrics.jsonl", "completions.csv"):
        assert (out / name).is_file(), name
    assert list((out / "tensorboard").rglob("events.out.tfevents.*"))
    config = json.loads((out / "train_config.json").read_text())
    assert config["MODEL_ID"] == "tiny" and config["NUM_GENERATIONS"] == 16 and config["REASONING_EFFORT"] == "low"
    assert config["derived"]["completions_per_step"] == 16 and config["derived"]["attn_implementation"] == "eager"
    metrics = [json.loads(line) for line in first["metrics"]]
    assert [m["step"] for m in metrics if "reward" in m] == list(range(1, FIRST_STEPS + 1))


def test_adapter_loads_with_peft_and_only_lora_weights_changed(run):
    from peft import PeftModel
    from safetensors.torch import load_file

    begin, end = run["watcher"].snapshots["begin"], run["watcher"].snapshots["end"]
    lora = [n for n in begin if "lora_" in n]
    base = [n for n in begin if "lora_" not in n]
    assert lora and base
    assert any(not torch.equal(begin[n], end[n]) for n in lora if "lora_B" in n)  # LoRA B starts at zero, then moves
    assert all(torch.equal(begin[n], end[n]) for n in base)  # base weights untouched
    model = PeftModel.from_pretrained(train_grpo.load_policy_model("tiny"), str(run["out"]))
    saved = load_file(run["first"]["adapter"])
    loaded = {n: p for n, p in model.named_parameters() if "lora_B" in n}
    assert len(loaded) == sum("lora_B" in k for k in saved) > 0
    trained = {k: v for k, v in end.items() if "lora_B" in k}
    for name, tensor in saved.items():
        if "lora_B" in name:
            key = name.replace(".weight", ".default.weight")
            assert torch.equal(tensor, trained[key])  # the first run's final adapter is what it trained


def test_completion_log_scores_each_completion_with_its_own_prompt(run):
    log = run["first"]["completions"]
    assert list(log.columns) == LOG_COLUMNS
    assert len(log) == 16 * FIRST_STEPS and log.groupby("step")["prompt"].nunique().eq(1).all()
    table = rewards_by_prompt(run["tokenizer"], "low")
    assert set(log["prompt"]) <= set(table)  # every prompt is a training prompt (never the eval one)
    valid = 0
    for _, row in log.iterrows():
        rewards, optimal = table[row["prompt"]]
        assert int(row["target_action"]) == optimal
        if row["action"] != "":
            assert float(row["reward"]) == pytest.approx(rewards[int(row["action"])], abs=1e-12)
            assert row["completion"].rstrip().endswith("<|return|>")
            valid += 1
        else:
            assert row["reward"] == ""
    assert valid / len(log) > 0.5  # the warm-up taught the format


ACTION_TOKEN_IDS = [15, 16, 17, 18]  # o200k tokens "0".."3"; "[k]" is tokenized "[", "k", "]"


def answer_contexts(log: pd.DataFrame, table: dict, per_prompt: int = 8) -> list[tuple[str, list[float]]]:
    """(prompt + completion up to its answer's "[", the prompt's rewards) for the first valid completions of each prompt.

    The analysis text before the answer is kept as it was sampled, so the policies compared below see the same contexts.
    """
    from data_reward import FINAL_HEADER

    contexts = []
    for prompt, rows in log[log["action"] != ""].groupby("prompt", sort=True):
        for completion in rows["completion"].head(per_prompt):
            final = list(FINAL_HEADER.finditer(completion))[-1].end()
            bracket = completion.index("[", final)
            contexts.append((prompt + completion[:bracket + 1], table[prompt][0]))
    return contexts


def expected_reward(model, tokenizer, contexts) -> float:
    """Mean over the contexts of sum_k p(k) r_k, with p the model's distribution over the 4 answer digits."""
    total = 0.0
    with torch.no_grad():
        for text, rewards in contexts:
            ids = tokenizer(text, add_special_tokens=False, return_tensors="pt").input_ids
            logits = model(input_ids=ids, logits_to_keep=1).logits[0, -1, ACTION_TOKEN_IDS]
            total += float(torch.softmax(logits.float(), dim=0) @ torch.tensor(rewards))
    return total / len(contexts)


def test_mean_reward_rises(run):
    """The trained policy's expected reward beats the starting policy's on the same answer contexts.

    Measured exactly from the answer distribution, not from the sampled rewards: 16 samples a step make the logged
    mean reward too noisy (about +-0.03 over 6 steps) to compare reliably within a 20-step CPU run.
    """
    from peft import PeftModel, set_peft_model_state_dict
    from safetensors.torch import load_file

    log, tokenizer = run["first"]["completions"], run["tokenizer"]
    contexts = answer_contexts(log, rewards_by_prompt(tokenizer, "low"))
    assert len({text.split("<|start|>assistant")[0] for text, _ in contexts}) == 4  # every training prompt
    model = PeftModel.from_pretrained(train_grpo.load_policy_model("tiny"), str(run["out"]))
    set_peft_model_state_dict(model, load_file(run["first"]["adapter"]))  # the step-20 adapter of the first run
    model.eval()
    trained = expected_reward(model, tokenizer, contexts)
    with model.disable_adapter():  # LoRA B starts at zero: the base model is the policy at step 0
        start = expected_reward(model, tokenizer, contexts)
    sampled = log.assign(r=pd.to_numeric(log["reward"], errors="coerce"))
    early, late = sampled[sampled["step"] <= 6], sampled[sampled["step"] > FIRST_STEPS - 6]
    print(f"expected reward {start:.3f} -> {trained:.3f}; sampled mean reward {early['r'].mean():.3f} -> "
          f"{late['r'].mean():.3f}; valid {early['r'].notna().mean():.2f} -> {late['r'].notna().mean():.2f}")
    assert trained > start + 0.03
    assert late["r"].notna().mean() > 0.5  # without giving up the answer format


def test_resume_continues_at_the_right_step(run):
    out, first = run["out"], run["first"]
    assert json.loads((out / "trainer_state.json").read_text())["global_step"] == RESUMED_TO
    metrics = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert [m["step"] for m in metrics if "reward" in m] == list(range(1, RESUMED_TO + 1))  # 11..20 redone once
    log = pd.read_csv(out / "completions.csv", keep_default_na=False)
    assert sorted(set(log["step"])) == list(range(1, RESUMED_TO + 1)) and len(log) == 16 * RESUMED_TO
    before = first["completions"]
    kept = log[log["step"] <= SAVE_STEPS].reset_index(drop=True)
    assert kept.equals(before[before["step"] <= SAVE_STEPS].reset_index(drop=True))
    for step in range(SAVE_STEPS + 1, RESUMED_TO + 1):  # the stream picks up where the checkpoint left it
        assert set(log[log["step"] == step]["prompt"]) == set(before[before["step"] == step]["prompt"])


def test_bad_setting_exits_with_error(tmp_path, capsys):
    assert train_grpo.main([f"--OUT={tmp_path}", "--NUM_GENERATIONS=1"]) == 1
    assert "error: NUM_GENERATIONS must be at least 2" in capsys.readouterr().err


def test_missing_data_exits_with_error(tmp_path, capsys):
    assert train_grpo.main(["--MODEL_ID=tiny", f"--DATA_DIR={tmp_path / 'none'}", f"--OUT={tmp_path / 'o'}"]) == 1
    assert "no training files" in capsys.readouterr().err


@pytest.mark.parametrize("message, shown", [
    # TRL's per-batch warning when every completion was invalid: dropped (it prints a whole prompt)
    ("All reward functions returned None for the following kwargs: ...", False),
    # TensorBoard refusing a None reward metric of such a step: dropped
    ('Trainer is attempting to log a value of "None" of type <class \'NoneType\'> for key "train/reward" as a scalar.',
     False),
    # a None metric that is not a reward still warns
    ('Trainer is attempting to log a value of "None" of type <class \'NoneType\'> for key "train/loss" as a scalar.',
     True),
    # unrelated warnings pass
    ("Something else went wrong", True),
])
def test_all_rewards_none_filter(message, shown):
    import logging

    record = logging.LogRecord("x", logging.WARNING, __file__, 1, message, None, None)
    assert train_grpo.AllRewardsNoneFilter().filter(record) is shown
