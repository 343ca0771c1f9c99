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
from grpo_fixtures import rewards_by_prompt, write_fixture_data
from transformers import TrainerCallback

import train_grpo
from data_reward import LOG_COLUMNS
from tes_grpo.model.model_loading import load_training_model, resolve_model_path
from tes_grpo.training.batch_layout import batch_layout

FIRST_STEPS, SAVE_STEPS, RESUMED_TO = 20, 10, 12


# ---------------------------------------------------------------------------------------------------------------
# Settings and wiring (no training)
# ---------------------------------------------------------------------------------------------------------------

# (overrides, longest prompt, GRPO_STEPS_PER_GENERATION, completions per step, per-pass batch, passes, generations)
LAYOUTS = [
    ({}, 871, None, 64, 8, 8, 8),  # the defaults on the shipped data: 8 x (871 + 4000) tokens fit 40,000
    ({}, 1316, None, 64, 4, 16, 16),  # longer prompts: smaller passes, same 64 completions, still one generation
    ({"MAX_COMPLETION_LEN": 1024}, 871, None, 64, 16, 4, 4),  # shorter completions: bigger passes
    ({"MAX_COMPLETION_LEN": 100000}, 871, None, 64, 1, 64, 64),  # never below one completion a pass
    ({"TRAIN_BATCH_SIZE": "8"}, 871, None, 64, 8, 8, 8),  # a number is taken as is
    ({"TRAIN_TOKENS_PER_PASS": 24000}, 871, None, 64, 4, 16, 16),  # a smaller budget
    ({}, 871, 2, 64, 8, 8, 2),  # GRPO_STEPS_PER_GENERATION=2: a generation every 2 passes, as exported
    ({"PROMPTS_PER_STEP": 2, "NUM_GENERATIONS": 8, "GRADIENT_ACCUMULATION_STEPS": 2}, 871, None, 32, 8, 4, 4),
    ({"MODEL_ID": "tiny"}, 871, None, 16, 16, 1, 1),  # the tiny preset: 1 x 8 generations x 2, 48 tokens
    ({"GENERATION_STEPS": 2}, 871, None, 64, 8, 8, 16),  # one generation batch of 128 for 2 optimizer steps
    ({"GENERATION_STEPS": 4, "MAX_COMPLETION_LEN": 1024}, 871, None, 64, 16, 4, 16),  # 256 for 4 steps, 4 passes each
    ({"MODEL_ID": "tiny", "GENERATION_STEPS": 2}, 871, None, 16, 16, 1, 2),  # the tiny run, 2 steps a batch
]


@pytest.mark.parametrize("overrides, longest, steps_per_generation, per_step, micro, passes, generation", LAYOUTS)
def test_batch_layout(overrides, longest, steps_per_generation, per_step, micro, passes, generation):
    settings = train_grpo.default_settings(**overrides)
    layout = batch_layout(settings, longest, steps_per_generation)
    assert (layout["completions_per_step"], layout["train_batch_size"], layout["gradient_accumulation_steps"],
            layout["steps_per_generation"]) == (per_step, micro, passes, generation)
    assert layout["generation_batch"] == layout["generation_sequences"] == generation * micro  # no plan: one call
    if steps_per_generation is None:
        assert layout["generation_batch"] == per_step * settings.GENERATION_STEPS
    if settings.TRAIN_BATCH_SIZE == "auto" and micro > 1:
        assert layout["worst_case_tokens_per_pass"] <= settings.TRAIN_TOKENS_PER_PASS


# (overrides, GRPO_STEPS_PER_GENERATION, words of the SettingsError)
BAD_LAYOUTS = [
    ({"TRAIN_BATCH_SIZE": "24"}, None, "must divide the 64"),  # 64 completions do not split into 24s
    ({"TRAIN_BATCH_SIZE": "8"}, 3, "GRPO_STEPS_PER_GENERATION=3"),  # 3 does not divide 8 passes
    ({"TRAIN_BATCH_SIZE": "4"}, 2, "whole groups"),  # 2 x 4 = 8 completions: half a group of 16
    ({"GENERATION_STEPS": 2}, 2, "GENERATION_STEPS=2 and GRPO_STEPS_PER_GENERATION=2 both set"),  # one or the other
]


@pytest.mark.parametrize("overrides, steps_per_generation, words", BAD_LAYOUTS)
def test_bad_layouts(overrides, steps_per_generation, words):
    with pytest.raises(train_grpo.SettingsError, match=words):
        batch_layout(train_grpo.default_settings(**overrides), 871, steps_per_generation)


def test_generation_steps_with_the_environments_cadence_stops_before_anything(tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("GRPO_STEPS_PER_GENERATION", "2")
    out = tmp_path / "run"
    assert train_grpo.main(["--MODEL_ID=tiny", "--GENERATION_STEPS=2", f"--OUT_DIR={out}"]) == 1
    assert "error: GENERATION_STEPS=2 and GRPO_STEPS_PER_GENERATION=2 both set" in capsys.readouterr().err
    assert not out.exists()  # stopped before the run folder, the data and the model


NAN, INF = float("nan"), float("inf")
# (overrides, words of the SettingsError: the setting and its value)
BAD_SETTINGS = [
    ({"NUM_GENERATIONS": 1}, "NUM_GENERATIONS=1: must be at least 2"),
    ({"LORA_EXPERT_LAYERS": ["seven"]}, "not a layer number"),
    ({"PROMPT_TOO_LONG": "cut"}, "PROMPT_TOO_LONG='cut'"),
    ({"SCALE_REWARDS": "std"}, "SCALE_REWARDS='std'"),
    ({"REASONING_EFFORT": "max"}, "REASONING_EFFORT='max'"),
    ({"DECODE_EXPERTS": "fast"}, "DECODE_EXPERTS='fast'"),
    ({"TRAIN_EXPERTS": "grouped_mm"}, "TRAIN_EXPERTS='grouped_mm'"),  # fused or transformers
    ({"DECODE_GRAPHS": "maybe"}, "DECODE_GRAPHS='maybe': must be one of auto, on, off"),
    ({"DECODE_GRAPHS": "1"}, "DECODE_GRAPHS='1'"),  # a plain choice: on or off, not a yes/no word
    ({"MAX_COMPLETION_LEN": 0}, "MAX_COMPLETION_LEN=0: must be at least 1"),
    ({"TRAIN_TOKENS_PER_PASS": 0}, "TRAIN_TOKENS_PER_PASS=0"),
    ({"TRAIN_BATCH_SIZE": "big"}, "TRAIN_BATCH_SIZE='big'"),
    ({"TRAIN_BATCH_SIZE": "0"}, "TRAIN_BATCH_SIZE='0'"),
    ({"LR": NAN}, "LR=nan"),  # nan, inf and negative learning rates must not reach the optimizer
    ({"LR": INF}, "LR=inf"),
    ({"LR": -1e-5}, "LR=-1e-05"),
    ({"TEMPERATURE": 0.0}, "TEMPERATURE=0.0"),  # 0 would divide the logits by zero
    ({"TEMPERATURE": NAN}, "TEMPERATURE=nan"),
    ({"BETA": -0.1}, "BETA=-0.1"),
    ({"WARMUP_RATIO": 5.0}, "WARMUP_RATIO=5.0"),
    ({"LR_SCHEDULER": "sawtooth"}, "LR_SCHEDULER='sawtooth'"),  # unknown scheduler
    ({"LOSS_TYPE": "ppo"}, "LOSS_TYPE='ppo'"),
    ({"OUT_DIR": ""}, "OUT_DIR=''"),
    ({"OUT_DIR": "  "}, "OUT_DIR='  '"),
    ({"INVALID_REWARD": INF}, "INVALID_REWARD=inf"),  # nan is allowed (TRL's masking), inf is not
    ({"VLLM_GPU_MEMORY_UTILIZATION": 1.5}, "VLLM_GPU_MEMORY_UTILIZATION=1.5"),
    ({"MEMORY_BUDGET_GB": -24.0}, "MEMORY_BUDGET_GB=-24.0"),  # a budget is GiB, not a margin
    ({"EXPERTS": "int4"}, "EXPERTS='int4'"),  # the experts' forms: auto, mxfp4, bf16
    ({"DECODE_LORA": "fused"}, "DECODE_LORA='fused'"),
    ({"DECODE_GLUE": "fused"}, "DECODE_GLUE='fused'"),  # auto, eager or compiled
    ({"IMPORTANCE_SAMPLING": "token"}, "IMPORTANCE_SAMPLING='token'"),
    ({"USE_VLLM": True, "DECODE_GRAPHS": "on"}, "both choose how completions are generated"),
    ({"DECODE_EXPERTS": "mxfp4", "DECODE_GRAPHS": "off"}, "DECODE_EXPERTS=mxfp4 is graph_decode's"),
    ({"DECODE_EXPERTS": "mxfp4", "USE_VLLM": True}, "DECODE_EXPERTS=mxfp4 is graph_decode's"),
    ({"DECODE_EXPERTS": "mxfp4_tiled"}, "DECODE_EXPERTS='mxfp4_tiled'"),  # gone: mxfp4 reads them as kept
    ({"DECODE_GLUE": "compiled", "DECODE_GRAPHS": "off"}, "DECODE_GLUE=compiled is graph_decode's"),
    ({"GENERATION_STEPS": 0}, "GENERATION_STEPS=0: must be at least 1"),
    ({"GENERATION_STEPS": 3}, "SAVE_STEPS=20: must be a multiple of GENERATION_STEPS=3"),  # a checkpoint mid-batch
    ({"GENERATION_STEPS": 4, "SAVE_STEPS": 8, "TOTAL_STEPS": 202}, "TOTAL_STEPS=202: must be a multiple of"),
]


@pytest.mark.parametrize("overrides, words", BAD_SETTINGS)
def test_bad_settings(overrides, words):
    with pytest.raises(train_grpo.SettingsError) as err:
        train_grpo.check_settings(train_grpo.default_settings(**overrides))
    assert words in str(err.value)


def test_nan_invalid_reward_is_a_valid_setting():
    from tes_grpo.run.script_config import resolve

    settings = resolve(vars(train_grpo), ["--INVALID_REWARD=nan"], allow_nan={"INVALID_REWARD"})
    assert settings.INVALID_REWARD != settings.INVALID_REWARD  # nan
    train_grpo.check_settings(settings)
    with pytest.raises(SystemExit):  # other float settings stay finite
        resolve(vars(train_grpo), ["--LR=nan"], allow_nan={"INVALID_REWARD"})


def test_default_settings_rejects_unknown_names():
    with pytest.raises(KeyError, match="NUM_GENERATION"):
        train_grpo.default_settings(NUM_GENERATION=4)


def test_tiny_preset_applies_only_to_tiny_and_not_over_explicit_values():
    big = train_grpo.default_settings()
    assert big.preset == {} and big.NUM_GENERATIONS == 16
    tiny = train_grpo.default_settings(MODEL_ID="tiny", TOTAL_STEPS=7)
    preset = train_grpo.PRESETS["MODEL_ID"]["tiny"]
    assert tiny.TOTAL_STEPS == 7 and tiny.NUM_GENERATIONS == preset["NUM_GENERATIONS"]
    assert "TOTAL_STEPS" not in tiny.preset and tiny.preset["LR"] == (train_grpo.LR, preset["LR"])


def test_help_shows_the_tiny_preset_quickly():
    import subprocess
    import sys
    import time

    start = time.perf_counter()
    done = subprocess.run([sys.executable, "train_grpo.py", "--help"], capture_output=True, text=True, check=True)
    assert time.perf_counter() - start < 10  # generous for a loaded CI machine; ~0.1 s idle (no torch import)
    assert "preset MODEL_ID=tiny" in done.stdout and "--MAX_COMPLETION_LEN=48" in done.stdout
    assert "--MAX_COMPLETION_LEN=4000" in done.stdout and "--INVALID_REWARD=0.0" in done.stdout


def test_defaults_are_the_reference_recipe():
    s = train_grpo.default_settings()
    recipe = {"LORA_R": 4, "LORA_ALPHA": 8, "LR": 5e-5, "LR_SCHEDULER": "linear", "TOTAL_STEPS": 200, "SAVE_STEPS": 20,
              "NUM_GENERATIONS": 16, "GRADIENT_ACCUMULATION_STEPS": 4, "PROMPTS_PER_STEP": 1,
              "MAX_COMPLETION_LEN": 4000, "REASONING_EFFORT": "medium", "LOSS_TYPE": "dr_grpo",
              "SCALE_REWARDS": "none", "BETA": 0.0, "INVALID_REWARD": 0.0}
    assert {name: s[name] for name in recipe} == recipe


# (environment, expected, error words)
ENVIRONMENTS = [
    ({}, {"log_completions": True, "completion_log_path": "", "steps_per_generation": None}, None),
    ({"GRPO_STEPS_PER_GENERATION": "2"}, {"log_completions": True, "completion_log_path": "",
                                          "steps_per_generation": 2}, None),  # an exported value wins
    ({"GRPO_LOG_COMPLETIONS": "0", "GRPO_COMPLETION_LOG_PATH": "x.csv"},
     {"log_completions": False, "completion_log_path": "x.csv", "steps_per_generation": None}, None),
    ({"GRPO_STEPS_PER_GENERATION": "two"}, None, "GRPO_STEPS_PER_GENERATION='two'"),
    ({"GRPO_LOG_COMPLETIONS": "maybe"}, None, "GRPO_LOG_COMPLETIONS='maybe'"),
]


@pytest.mark.parametrize("environ, expected, words", ENVIRONMENTS)
def test_read_environment(environ, expected, words):
    if words is None:
        assert train_grpo.read_environment(environ) == expected
    else:
        with pytest.raises(train_grpo.SettingsError, match=words):
            train_grpo.read_environment(environ)


def test_grpo_config_uses_cache_stream_options_and_loss(tmp_path):
    settings = train_grpo.default_settings(OUT_DIR=str(tmp_path))
    layout = batch_layout(settings, 871)
    args = train_grpo.build_grpo_config(settings, layout, cuda=False)
    assert args.generation_kwargs == {"use_cache": True}  # generation keeps its KV cache under checkpointing
    assert args.shuffle_dataset is False and args.max_steps == settings["TOTAL_STEPS"]
    assert (args.per_device_train_batch_size, args.gradient_accumulation_steps, args.steps_per_generation) == (8, 8, 8)
    assert args.generation_batch_size == 64 and args.num_generations == 16  # one generation batch per step
    assert args.loss_type == "dr_grpo" and args.scale_rewards == "none" and args.beta == 0.0
    assert args.max_completion_length == 4000 and args.gradient_checkpointing is True
    assert args.learning_rate == 5e-5 and args.lr_scheduler_type == "linear" and args.save_steps == 20
    assert args.bf16 is False  # float32 on CPU (bf16=True is asked for on CUDA only)


# (overrides, TRL's per-device batch, gradient accumulation, steps_per_generation, generation_batch_size)
GENERATION_CONFIGS = [
    ({}, 8, 8, 8, 64),  # the defaults: one generation batch per optimizer step
    ({"GENERATION_STEPS": 2}, 8, 8, 16, 128),  # 2 steps' completions sampled together
    ({"GENERATION_STEPS": 4}, 8, 8, 32, 256),  # 4 steps'
]


@pytest.mark.parametrize("overrides, per_device, accumulation, steps, batch", GENERATION_CONFIGS)
def test_generation_steps_reach_grpo_config_and_the_stream(tmp_path, overrides, per_device, accumulation, steps,
                                                           batch):
    settings = train_grpo.default_settings(OUT_DIR=str(tmp_path), **overrides)
    args = train_grpo.build_grpo_config(settings, batch_layout(settings, 871), cuda=False)
    assert (args.per_device_train_batch_size, args.gradient_accumulation_steps, args.steps_per_generation,
            args.generation_batch_size) == (per_device, accumulation, steps, batch)
    rows = [{"prompt": f"p{i}", "optimal_action": 0, **{f"reward_action_{k}": 0.25 for k in range(4)}}
            for i in range(40)]
    stream = train_grpo.build_stream(rows, settings, processes=1)
    draw = [row["prompt"] for _, group in zip(range(stream.steps_per_draw), stream.micro_steps(), strict=False)
            for row in group]
    assert len(draw) == len(set(draw)) == batch // settings.NUM_GENERATIONS  # a generation batch's prompts distinct


@pytest.mark.parametrize("device, expected", [("cuda", "flex_attention"), ("cpu", "eager")])
def test_attention_and_dtype_by_device(device, expected):
    from tes_grpo.model.model_loading import resolve_attention, resolve_dtype

    assert resolve_attention("auto", device) == expected
    assert resolve_attention("sdpa", device) == "sdpa"
    assert resolve_dtype("auto", device) == (torch.bfloat16 if device == "cuda" else torch.float32)


@pytest.mark.parametrize("layers, expected", [
    ((), None),  # attention only
    ((7, 15), ["layers.7.mlp.experts.gate_up_proj", "layers.7.mlp.experts.down_proj",
               "layers.15.mlp.experts.gate_up_proj", "layers.15.mlp.experts.down_proj"]),
])
def test_lora_config(layers, expected):
    config = train_grpo.build_lora_config(4, 8, layers)
    assert config.target_modules == "all-linear" and config.lora_dropout == 0.0 and config.r == 4
    assert (sorted(config.target_parameters) if config.target_parameters else None) == (
        sorted(expected) if expected else None)


def test_cpu_scoring_patch_is_idempotent():
    import trl.trainer.utils as trl_utils

    from tes_grpo.patches.trl_patches import score_only_completion_tokens_on_cpu

    assert score_only_completion_tokens_on_cpu()
    patched = trl_utils._use_triton
    assert score_only_completion_tokens_on_cpu() and trl_utils._use_triton is patched
    assert patched(torch.device("cpu")) is True


# ---------------------------------------------------------------------------------------------------------------
# The tiny MXFP4 checkpoint
# ---------------------------------------------------------------------------------------------------------------

@pytest.mark.slow
def test_tiny_checkpoint_is_in_the_real_mxfp4_layout():
    from safetensors import safe_open

    from tes_grpo.experts.mxfp4 import fake_quantize_expert_param

    folder = Path(resolve_model_path("tiny"))
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
    # through Mxfp4Config(dequantize=True), like the 20B with EXPERTS=bf16
    model = load_training_model(resolve_model_path("tiny"), experts="bf16")
    experts = model.model.layers[0].mlp.experts.gate_up_proj.detach()
    from tes_grpo.model.model_loading import resolve_attention, resolve_dtype

    device = model.device.type  # the loader's choice: CUDA where there is one
    assert model.dtype == resolve_dtype("auto", device)
    assert model.config._attn_implementation == resolve_attention("auto", device)
    assert torch.equal(fake_quantize_expert_param(experts).float(), experts)  # exactly on the MXFP4 grid


# ---------------------------------------------------------------------------------------------------------------
# Generation keeps its KV cache with gradient checkpointing on (the GPU default)
# ---------------------------------------------------------------------------------------------------------------

@pytest.mark.slow
def test_generation_uses_kv_cache_with_gradient_checkpointing(tmp_path, tokenizer):
    data = write_fixture_data(tmp_path, tokenizer)
    settings = train_grpo.default_settings(
        MODEL_ID="tiny", DATA_DIR=str(data), EVAL_DIR=str(data / "eval"), OUT_DIR=str(tmp_path / "run"), TOTAL_STEPS=1,
        NUM_GENERATIONS=2, GRADIENT_ACCUMULATION_STEPS=1, MAX_COMPLETION_LEN=6, GRADIENT_CHECKPOINTING=True,
        TRAIN_EXPERTS="fused",  # the GPU's training experts (eager on a CPU): recomputed under checkpointing too
        TRAIN_GLUE="compiled",  # the GPU's training glue (its functions eager on a CPU), under checkpointing too
        DECODE_GRAPHS="off")  # transformers' generate and its cache (graph_decode, a GPU's default, has its own)
    model = load_training_model(resolve_model_path("tiny"))
    frame = train_grpo.load_training_data(settings, tokenizer)
    layout = batch_layout(settings, int(frame["prompt_tokens"].max()))
    calls = []
    model.model.embed_tokens.register_forward_hook(
        lambda module, inputs, output: calls.append((inputs[0].shape[1], torch.is_grad_enabled())))
    dataset = train_grpo.build_stream(frame, settings).to_iterable_dataset()
    trainer = train_grpo.build_trainer(settings, model, tokenizer, dataset, layout)
    trainer.train()
    generation = [length for length, grad in calls if not grad]
    prompt_len = generation[0]
    assert prompt_len > 500 and 2 <= len(generation) <= 6
    assert generation[1:] == [1] * (len(generation) - 1)  # one new token per step: the cache holds the prefix
    assert any(grad and length > prompt_len for length, grad in calls)  # then the training forward
    assert trainer.model.base_model.model.is_gradient_checkpointing
    from tes_grpo.experts.fused_experts import uses_fused_experts

    assert all(uses_fused_experts(layer.mlp.experts) for layer in trainer.model.base_model.model.model.layers)
    from tes_grpo.layers.train_glue import uses_train_glue

    layer = trainer.model.base_model.model.model.layers[0]
    assert uses_train_glue(layer.input_layernorm) and uses_train_glue(layer.self_attn.q_proj)


# ---------------------------------------------------------------------------------------------------------------
# INVALID_REWARD: invalid completions get a learning signal (through TRL's own advantage computation)
# ---------------------------------------------------------------------------------------------------------------

def group_advantages(tmp_path, tokenizer, monkeypatch, invalid_reward: float) -> list[float]:
    """One real GRPO step on the tiny model (one prompt x 8 completions) in which every other completion answers
    action 1 and the others are invalid; returns the advantages TRL handed to the loss, sorted."""
    import data_reward

    data = write_fixture_data(tmp_path, tokenizer)
    settings = train_grpo.default_settings(
        MODEL_ID="tiny", DATA_DIR=str(data), EVAL_DIR=str(data / "eval"), OUT_DIR=str(tmp_path / "run"), TOTAL_STEPS=1,
        GRADIENT_ACCUMULATION_STEPS=1, INVALID_REWARD=invalid_reward)
    calls = iter(range(10**6))
    monkeypatch.setattr(data_reward, "is_truncated", lambda ids: False)
    monkeypatch.setattr(data_reward, "parse_action", lambda text: 1 if next(calls) % 2 == 0 else None)
    frame = train_grpo.load_training_data(settings, tokenizer)
    layout = batch_layout(settings, int(frame["prompt_tokens"].max()))
    trainer = train_grpo.build_trainer(settings, load_training_model(resolve_model_path("tiny")), tokenizer,
                                       train_grpo.build_stream(frame, settings).to_iterable_dataset(), layout)
    seen = []
    compute_loss = trainer.compute_loss

    def record(model, inputs, *args, **kwargs):
        seen.extend(inputs["advantages"].tolist())
        return compute_loss(model, inputs, *args, **kwargs)

    trainer.compute_loss = record
    trainer.train()
    assert len(seen) == 8
    return sorted(seen)


@pytest.mark.slow
@pytest.mark.parametrize("invalid_reward", [0.0, float("nan")])
def test_invalid_completions_advantage(tmp_path, tokenizer, monkeypatch, invalid_reward):
    advantages = group_advantages(tmp_path, tokenizer, monkeypatch, invalid_reward)
    if invalid_reward == 0.0:
        # the default: 4 valid at r (the prompt's reward_action_1: 0.40 or 0.85), 4 invalid at 0 -> group mean r/2,
        # so the invalid ones are pushed down and the valid ones pulled up (Dr. GRPO: advantages not scaled)
        reward = 2 * advantages[-1]
        assert reward == pytest.approx(0.40) or reward == pytest.approx(0.85)
        assert advantages == pytest.approx([-reward / 2] * 4 + [reward / 2] * 4)
    else:
        # nan: TRL leaves the invalid ones out of the mean and gives them advantage 0 (no gradient at all)
        assert advantages == pytest.approx([0.0] * 8)


# ---------------------------------------------------------------------------------------------------------------
# GENERATION_STEPS: one generation batch for several optimizer steps
# ---------------------------------------------------------------------------------------------------------------

class LoraPerStep(TrainerCallback):
    """The trainable (LoRA) weights at train begin and after every optimizer step."""

    def __init__(self):
        self.weights = []

    def keep(self, model):
        self.weights.append({n: p.detach().clone() for n, p in model.named_parameters() if p.requires_grad})

    def on_train_begin(self, args, state, control, model=None, **kwargs):
        self.keep(model)

    def on_step_end(self, args, state, control, model=None, **kwargs):
        self.keep(model)


@pytest.mark.slow
def test_two_optimizer_steps_from_one_generation(tmp_path, tokenizer, monkeypatch, capsys):
    """GENERATION_STEPS=2 through train_grpo.main: one generate-and-score for two optimizer steps, of two distinct
    prompts; each step trains half of the batch (TRL shuffles it across them), every completion once, against the
    log-probabilities TRL took at generation; both steps change the adapter; the log labels the batch's first step.
    Then a resume from the step-2 checkpoint to step 4 generates once, at step 3, from the stream's next draw."""
    from trl import GRPOTrainer

    generated_at, trained = [], []
    generate, compute_loss = GRPOTrainer._generate_and_score_completions, GRPOTrainer.compute_loss

    def counted_generate(self, inputs):
        generated_at.append(self.state.global_step)
        return generate(self, inputs)

    def recorded_loss(self, model, inputs, *args, **kwargs):
        rows = zip(inputs["prompt_ids"], inputs["prompt_mask"], strict=True)
        prompts = [tuple(ids[mask.bool()].tolist()) for ids, mask in rows]
        trained.append((self.state.global_step + 1, prompts, inputs.get("old_per_token_logps") is not None))
        return compute_loss(self, model, inputs, *args, **kwargs)

    monkeypatch.setattr(GRPOTrainer, "_generate_and_score_completions", counted_generate)
    monkeypatch.setattr(GRPOTrainer, "compute_loss", recorded_loss)
    monkeypatch.delenv("GRPO_COMPLETION_LOG_PATH", raising=False)
    monkeypatch.delenv("GRPO_LOG_COMPLETIONS", raising=False)
    monkeypatch.delenv("GRPO_STEPS_PER_GENERATION", raising=False)
    data, out, lora = write_fixture_data(tmp_path, tokenizer), tmp_path / "run", LoraPerStep()
    argv = ["--MODEL_ID=tiny", f"--DATA_DIR={data}", f"--EVAL_DIR={data / 'eval'}", f"--OUT_DIR={out}",
            "--GRADIENT_ACCUMULATION_STEPS=1", "--SAVE_STEPS=2", "--GENERATION_STEPS=2",
            "--EVAL_STEPS=0"]  # an evaluation would generate too
    assert train_grpo.main([*argv, "--TOTAL_STEPS=2"], callbacks=[lora]) == 0
    assert generated_at == [0]  # one generation, before step 1
    assert [step for step, _, _ in trained] == [1, 2]  # one pass a step (8 completions), both steps
    assert all(len(prompts) == 8 and old for _, prompts, old in trained)
    drawn = [prompt for _, prompts, _ in trained for prompt in prompts]
    assert sorted(drawn.count(prompt) for prompt in set(drawn)) == [8, 8]  # 2 distinct prompts, each group trained once
    assert [len(lora.weights), *(any(not torch.equal(before[n], after[n]) for n in before)
                                 for before, after in zip(lora.weights[:-1], lora.weights[1:], strict=True))] \
        == [3, True, True]  # weights after begin, step 1, step 2: each step moved them
    log = pd.read_csv(out / "completions.csv", keep_default_na=False)
    assert len(log) == 16 and set(log["step"]) == {1} and sorted(set(log["micro_step"])) == [0, 1]
    assert log.groupby("micro_step")["prompt"].nunique().eq(1).all() and log["prompt"].nunique() == 2
    metrics = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert [m["step"] for m in metrics if "loss" in m] == [1, 2]  # both steps trained
    assert [m["step"] for m in metrics if "reward" in m] == [1]  # rewards are logged where the batch was scored
    assert "step 2/2  loss " in capsys.readouterr().out  # the progress line of the step without generation
    layout = json.loads((out / "train_config.json").read_text())["derived"]
    assert (layout["steps_per_generation"], layout["generation_steps"], layout["generation_batch"]) == (2, 2, 16)

    assert train_grpo.main([*argv, "--TOTAL_STEPS=4", "--RESUME=1"]) == 0
    assert generated_at == [0, 2] and [step for step, _, _ in trained] == [1, 2, 3, 4]
    log = pd.read_csv(out / "completions.csv", keep_default_na=False)
    assert sorted(set(log["step"])) == [1, 3] and len(log) == 32
    settings = train_grpo.default_settings(MODEL_ID="tiny", DATA_DIR=str(data), EVAL_DIR=str(data / "eval"),
                                           GRADIENT_ACCUMULATION_STEPS=1, GENERATION_STEPS=2)
    draws = train_grpo.build_stream(train_grpo.load_training_data(settings, tokenizer), settings, 1).micro_steps()
    expected = [[row["prompt"] for _ in range(2) for row in next(draws)] for _ in range(2)]  # 2 draws of 2 prompts
    assert [list(log[log["step"] == step].groupby("micro_step")["prompt"].first()) for step in (1, 3)] == expected


# ---------------------------------------------------------------------------------------------------------------
# End to end: train_grpo.main on the tiny model, then resume
# ---------------------------------------------------------------------------------------------------------------

class WeightWatcher(TrainerCallback):
    """Copies the trainable (LoRA) and a sample of frozen (base) weights at train begin and end."""

    def __init__(self):
        self.snapshots = {}

    def snapshot(self, model):
        return {name: p.detach().clone() for name, p in model.named_parameters()
                if p.requires_grad
                or name.endswith(("q_proj.base_layer.weight", "experts.gate_up_proj", "lm_head.weight"))}

    def on_train_begin(self, args, state, control, model=None, **kwargs):
        self.snapshots["begin"] = self.snapshot(model)

    def on_train_end(self, args, state, control, model=None, **kwargs):
        self.snapshots["end"] = self.snapshot(model)


@pytest.fixture(scope="module")
def run(tmp_path_factory, tokenizer):
    root = tmp_path_factory.mktemp("e2e")
    data = write_fixture_data(root, tokenizer)
    out = root / "run"
    argv = ["--MODEL_ID=tiny", f"--DATA_DIR={data}", f"--EVAL_DIR={data / 'eval'}", f"--OUT_DIR={out}",
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
        finished = folder_contents(out)
        assert train_grpo.main(argv + [f"--TOTAL_STEPS={RESUMED_TO}", "--RESUME=1"]) == 0  # a finished run again
        again = folder_contents(out)
        assert train_grpo.main(argv + [f"--TOTAL_STEPS={SAVE_STEPS}",  # an earlier checkpoint, already at the end
                                       f"--RESUME={out / f'checkpoint-{SAVE_STEPS:06d}'}"]) == 0
        earlier = folder_contents(out)
    return {"out": out, "first": first, "watcher": watcher, "tokenizer": tokenizer, "finished": finished,
            "again": again, "earlier": earlier}


def folder_contents(folder: Path) -> dict:
    """Every file below folder with its bytes (the run folder of the tiny model is small)."""
    return {str(p.relative_to(folder)): p.read_bytes() for p in sorted(folder.rglob("*")) if p.is_file()}


@pytest.mark.slow
def test_run_writes_adapter_checkpoints_config_and_logs(run):
    out, first = run["out"], run["first"]
    assert first["checkpoints"] == ["checkpoint-000010", "checkpoint-000020"]
    for name in ("adapter_model.safetensors", "adapter_config.json", "tokenizer.json", "trainer_state.json",
                 "train_config.json", "metrics.jsonl", "completions.csv"):
        assert (out / name).is_file(), name
    assert list((out / "tensorboard").rglob("events.out.tfevents.*"))
    config = json.loads((out / "train_config.json").read_text())
    assert config["MODEL_ID"] == "tiny" and config["NUM_GENERATIONS"] == 16 and config["REASONING_EFFORT"] == "medium"
    from tes_grpo.model.model_loading import resolve_attention

    device = "cuda" if torch.cuda.is_available() else "cpu"
    assert config["derived"]["completions_per_step"] == 16
    assert config["derived"]["attn_implementation"] == resolve_attention("auto", device)
    metrics = [json.loads(line) for line in first["metrics"]]
    assert [m["step"] for m in metrics if "reward" in m] == list(range(1, FIRST_STEPS + 1))


@pytest.mark.slow
def test_adapter_loads_with_peft_and_only_lora_weights_changed(run):
    from peft import PeftModel
    from safetensors.torch import load_file

    begin, end = run["watcher"].snapshots["begin"], run["watcher"].snapshots["end"]
    lora = [n for n in begin if "lora_" in n]
    base = [n for n in begin if "lora_" not in n]
    assert lora and base
    assert any(not torch.equal(begin[n], end[n]) for n in lora if "lora_B" in n)  # LoRA B starts at zero, then moves
    assert all(torch.equal(begin[n], end[n]) for n in base)  # base weights untouched
    model = PeftModel.from_pretrained(load_training_model(resolve_model_path("tiny")), str(run["out"]))
    saved = load_file(run["first"]["adapter"])
    loaded = {n: p for n, p in model.named_parameters() if "lora_B" in n}
    assert len(loaded) == sum("lora_B" in k for k in saved) > 0
    trained = {k: v for k, v in end.items() if "lora_B" in k}
    for name, tensor in saved.items():
        if "lora_B" in name:
            key = name.replace(".weight", ".default.weight")
            assert torch.equal(tensor, trained[key].cpu())  # the first run's final adapter is what it trained


@pytest.mark.slow
def test_completion_log_scores_each_completion_with_its_own_prompt(run):
    log = run["first"]["completions"]
    assert list(log.columns) == LOG_COLUMNS
    assert len(log) == 16 * FIRST_STEPS and log.groupby("step")["prompt"].nunique().eq(1).all()
    table = rewards_by_prompt(run["tokenizer"], "medium")
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
            assert float(row["reward"]) == train_grpo.INVALID_REWARD  # scored, so the group pushes it down
    assert valid / len(log) > 0.5  # the warm-up taught the format


ACTION_TOKEN_IDS = [15, 16, 17, 18]  # o200k tokens "0".."3"; "[k]" is tokenized "[", "k", "]"


def answer_contexts(log: pd.DataFrame, table: dict, per_prompt: int = 8) -> list[tuple[str, list[float]]]:
    """(prompt + completion up to its answer's "[", the prompt's rewards) for each prompt's first valid completions.

    The analysis text before the answer is kept as it was sampled, so the policies compared below see the same contexts.
    """
    from tes_grpo.task.harmony import FINAL_HEADER

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
            ids = tokenizer(text, add_special_tokens=False, return_tensors="pt").input_ids.to(model.device)
            logits = model(input_ids=ids, logits_to_keep=1).logits[0, -1, ACTION_TOKEN_IDS]
            total += float(torch.softmax(logits.float(), dim=0).cpu() @ torch.tensor(rewards))
    return total / len(contexts)


@pytest.mark.slow
def test_mean_reward_rises(run):
    """The trained policy's expected reward beats the starting policy's on the same answer contexts.

    Measured exactly from the answer distribution, not from the sampled rewards: 16 samples a step make the logged
    mean reward too noisy (about +-0.03 over 6 steps) to compare reliably within a 20-step CPU run.
    """
    from peft import PeftModel, set_peft_model_state_dict
    from safetensors.torch import load_file

    log, tokenizer = run["first"]["completions"], run["tokenizer"]
    contexts = answer_contexts(log, rewards_by_prompt(tokenizer, "medium"))
    assert len({text.split("<|start|>assistant")[0] for text, _ in contexts}) == 4  # every training prompt
    model = PeftModel.from_pretrained(load_training_model(resolve_model_path("tiny")), str(run["out"]))
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


@pytest.mark.slow
def test_resume_continues_at_the_right_step(run):
    out, first = run["out"], run["first"]
    assert json.loads((out / "trainer_state.json").read_text())["global_step"] == RESUMED_TO
    metrics = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert [m["step"] for m in metrics if "reward" in m] == list(range(1, RESUMED_TO + 1))  # 11..20 redone once
    log = pd.read_csv(out / "completions.csv", keep_default_na=False)
    assert sorted(set(log["step"])) == list(range(1, RESUMED_TO + 1)) and len(log) == 16 * RESUMED_TO
    before = first["completions"]
    kept = log[log["step"] <= SAVE_STEPS].reset_index(drop=True)
    # as text: pandas infers a column's dtype from all its rows, and the first log holds steps 11-20 too
    assert kept.astype(str).equals(before[before["step"] <= SAVE_STEPS].reset_index(drop=True).astype(str))
    for step in range(SAVE_STEPS + 1, RESUMED_TO + 1):  # the stream picks up where the checkpoint left it
        assert set(log[log["step"] == step]["prompt"]) == set(before[before["step"] == step]["prompt"])


@pytest.mark.slow
def test_resuming_a_finished_run_changes_nothing(run):
    """RESUME=1 at TOTAL_STEPS: nothing to train (the trainer would run a step past max_steps and overwrite the
    adapter)."""
    for later in ("again", "earlier"):  # RESUME=1, and a checkpoint at its TOTAL_STEPS: no log row is dropped either
        assert run[later].keys() == run["finished"].keys() and "adapter_model.safetensors" in run[later]
        changed = [name for name in run[later] if run[later][name] != run["finished"][name]]
        assert not changed, (later, changed)


def test_settings_that_conflict_stop_before_the_model_loads(tmp_path, tokenizer, capsys, monkeypatch):
    from tes_grpo.model import model_loading

    monkeypatch.setattr(model_loading, "load_training_model", lambda *args, **kwargs: pytest.fail("model loaded"))
    data = write_fixture_data(tmp_path, tokenizer)
    code = train_grpo.main(["--MODEL_ID=tiny", "--TRAIN_BATCH_SIZE=5", f"--DATA_DIR={data}",
                            f"--EVAL_DIR={data / 'eval'}", f"--OUT_DIR={tmp_path / 'run'}"])
    assert code == 1 and "error: TRAIN_BATCH_SIZE=5 must divide the 16 completions" in capsys.readouterr().err


@pytest.mark.parametrize("model_id, words", [
    ("{tmp}/no-such-model", "MODEL_ID='{tmp}/no-such-model': no such folder; give a checkpoint folder"),
    ("{tmp}", "the folder has no config.json"),  # a folder, but not a checkpoint
    ("no-such-org/no-such-model", "not in the local Hugging Face cache, and HF_HUB_OFFLINE=1 keeps the Hub off"),
    ("tinyy", "MODEL_ID='tinyy' (did you mean tiny?)"),  # a near miss, offline: no Hub asked, no retries
])
def test_a_model_that_cannot_be_loaded_is_one_error_line(tmp_path, capsys, monkeypatch, model_id, words):
    """Said before torch is imported (sources.check_model_id): the model loader is never reached."""
    import huggingface_hub.constants

    from tes_grpo.model import model_loading

    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", True)  # as HF_HUB_OFFLINE=1 sets it at import
    monkeypatch.setattr(model_loading, "load_training_model", lambda *args, **kwargs: pytest.fail("model loaded"))
    monkeypatch.setattr(model_loading, "resolve_model_path", lambda *args, **kwargs: pytest.fail("model resolved"))
    code = train_grpo.main([f"--MODEL_ID={model_id.format(tmp=tmp_path)}", f"--OUT_DIR={tmp_path / 'run'}"])
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 1 and len(err) == 1 and err[0].startswith("error: MODEL_ID=")
    assert words.format(tmp=tmp_path) in err[0], err[0]


def test_bad_setting_exits_with_error(tmp_path, capsys):
    assert train_grpo.main([f"--OUT_DIR={tmp_path}", "--NUM_GENERATIONS=1"]) == 1
    assert "error: NUM_GENERATIONS=1: must be at least 2" in capsys.readouterr().err


@pytest.mark.slow
def test_missing_data_exits_with_error(tmp_path, capsys):
    assert train_grpo.main(["--MODEL_ID=tiny", f"--DATA_DIR={tmp_path / 'none'}", f"--OUT_DIR={tmp_path / 'o'}"]) == 1
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
    from tes_grpo.patches.trl_patches import AllRewardsNoneFilter

    assert AllRewardsNoneFilter().filter(record) is shown


# ---------------------------------------------------------------------------------------------------------------
# The checkpoint's config.json is read once per run, and the loaders take the config they are given
# ---------------------------------------------------------------------------------------------------------------

class _Loaded(Exception):
    """Raised by the stand-in loader: the run has gone as far as this test looks."""


def config_reads(monkeypatch) -> list[str]:
    """Every config.json transformers reads from now on (AutoConfig, a model's from_pretrained): the list of paths."""
    from transformers.configuration_utils import PreTrainedConfig

    reads = []
    original = PreTrainedConfig.get_config_dict.__func__

    def counting(cls, pretrained_model_name_or_path, **kwargs):
        reads.append(str(pretrained_model_name_or_path))
        return original(cls, pretrained_model_name_or_path, **kwargs)

    monkeypatch.setattr(PreTrainedConfig, "get_config_dict", classmethod(counting))
    return reads


def test_a_run_reads_the_checkpoints_config_once_and_hands_it_to_the_loader(tmp_path, tokenizer, monkeypatch):
    from tes_grpo.model import model_loading
    from tes_grpo.task.harmony import load_tokenizer

    seen = {}

    def loader(path, *args, **kwargs):
        seen.update(kwargs, path=path, reads=list(reads))
        raise _Loaded

    monkeypatch.setattr(model_loading, "load_training_model", loader)
    data = write_fixture_data(tmp_path, tokenizer)
    model_path = resolve_model_path("tiny")
    load_tokenizer(model_path)  # cached per process: transformers' AutoTokenizer reads config.json on its own
    reads = config_reads(monkeypatch)
    with pytest.raises(_Loaded):
        train_grpo.main(["--MODEL_ID=tiny", f"--DATA_DIR={data}", f"--EVAL_DIR={data / 'eval'}",
                         f"--OUT_DIR={tmp_path / 'run'}"])
    assert seen["path"] == model_path and seen["reads"] == [model_path]  # AutoConfig's, before the data
    assert seen["config"].model_type == "gpt_oss" and seen["config"].quantization_config["quant_method"] == "mxfp4"


@pytest.mark.parametrize("experts", ["mxfp4", "bf16"])
def test_the_training_loader_reads_no_config_when_given_one(experts, monkeypatch, capsys):
    from transformers import AutoConfig

    model_path = resolve_model_path("tiny")
    config = AutoConfig.from_pretrained(model_path)
    reads = config_reads(monkeypatch)
    model = load_training_model(model_path, experts=experts, config=config)
    assert reads == []
    assert model.config.num_hidden_layers == config.num_hidden_layers
    assert config.quantization_config["quant_method"] == "mxfp4"  # the caller's config is left as it was
    assert ("resident" in capsys.readouterr().out) == (experts == "mxfp4")
