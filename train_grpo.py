"""GRPO + LoRA fine-tuning of gpt-oss on the TES datasets; leaves a LoRA adapter in a run folder under runs/.

    .venv/bin/python train_grpo.py --MODEL_ID=tiny     # embedded tiny gpt-oss on CPU, a few minutes (see TINY_DEFAULTS)
    .venv/bin/python train_grpo.py                     # openai/gpt-oss-20b on one H100/H200
    .venv/bin/python train_grpo.py --RESUME=1          # continue a killed run from the last checkpoint in OUT
    .venv/bin/python train_grpo.py --help              # every setting with its default
    .venv/bin/accelerate launch --config_file configs/accelerate/ddp.yaml train_grpo.py    # several GPUs, one host
    .venv/bin/accelerate launch --config_file configs/accelerate/fsdp2.yaml train_grpo.py  # weights sharded (FSDP2)

One code path for both: the checkpoint (MXFP4, like openai/gpt-oss-20b) is loaded with
`Mxfp4Config(dequantize=True)` (bf16 on CUDA, float32 on CPU), LoRA is added by PEFT (`target_modules="all-linear"`,
i.e. the attention projections; LORA_EXPERT_LAYERS also adapts chosen layers' MoE experts through PEFT's
`target_parameters`), prompts come from `StepStream` (step_stream.py) and are scored by `data_reward.reward_fn`
inside TRL's `GRPOTrainer`. `MODEL_ID=tiny` builds the tiny checkpoint once (tiny_model.py, cached in
runs/tiny-gpt-oss/) and scales a few 20B-sized settings down (TINY_DEFAULTS, printed at start; any of them can
still be set on the command line).

Batch layout: each optimizer step trains on PROMPTS_PER_STEP x NUM_GENERATIONS x GRADIENT_ACCUMULATION_STEPS
completions (64 at the defaults), generated in one batch at the start of the step. TRAIN_BATCH_SIZE completions
go through each forward/backward pass (default PROMPTS_PER_STEP x NUM_GENERATIONS). Under `accelerate launch` with
N processes these are per process: an optimizer step trains N times as many completions, of distinct prompts
(see build_stream); logs, metrics and the adapter are still written once, by rank 0 (processes.py).

Written to OUT: adapter_model.safetensors + adapter_config.json + tokenizer files + trainer_state.json at the end;
checkpoint-000010-style folders every SAVE_STEPS (adapter, optimizer, scheduler, RNG, trainer state);
train_config.json (the resolved settings); metrics.jsonl (one JSON object per logged step); completions.csv
(every completion with its parsed action and reward; see data_reward.py); tensorboard/ (TensorBoard events).
"""

from __future__ import annotations

import json
import os
import re
import shutil
import sys
import time
from pathlib import Path

from tes_grpo.fileio import InputError, atomic_write_text
from tes_grpo.processes import (is_main_process, local_rank, process_count, process_rank, say, start_process_group,
                       uses_fsdp, wait_for_everyone)
from tes_grpo.script_config import configure, constants_of, parse_overrides, save_config

MODEL_ID = "openai/gpt-oss-20b"  # hub id or local folder of an MXFP4 gpt-oss checkpoint; "tiny" = embedded tiny model
OUT = "runs/grpo-gpt-oss-20b"  # run folder: adapter, checkpoints, train_config.json, metrics.jsonl, completions.csv
DATA_DIR = "data"  # training CSVs: every *_harmony.csv below it, EVAL_DIR left out
EVAL_DIR = "data/eval"  # evaluation split, never trained on
NUM_GENERATIONS = 16  # completions sampled per prompt (the GRPO group)
PROMPTS_PER_STEP = 1  # distinct prompts per micro-step (per gradient-accumulation slot)
TRAIN_BATCH_SIZE: int | None = None  # completions per forward/backward pass; None = PROMPTS_PER_STEP*NUM_GENERATIONS
GRADIENT_ACCUMULATION_STEPS = 4  # micro-steps per optimizer step (one generation batch feeds them all)
MAX_PROMPT_LEN = 2048  # tokens; longer prompts fail at load or are skipped (PROMPT_TOO_LONG), never cut
PROMPT_TOO_LONG = "error"  # "error": stop naming file and row; "skip": drop them and print how many
MAX_COMPLETION_LEN = 512  # tokens generated per completion; a completion cut here scores NaN
TOTAL_STEPS = 200  # optimizer steps (the stream is endless, so this sets the run length)
SAVE_STEPS = 25  # optimizer steps between checkpoints
KEEP_CHECKPOINTS = 4  # newest checkpoints kept in OUT (older ones deleted); 0 = keep all
LR = 1e-5  # AdamW learning rate for the LoRA weights
LR_SCHEDULER = "constant"  # transformers scheduler name: constant, linear, cosine, ...
WARMUP_RATIO = 0.0  # fraction of TOTAL_STEPS with linear learning-rate warm-up
LORA_R = 16  # LoRA rank
LORA_ALPHA = 32  # LoRA scaling numerator (scale = LORA_ALPHA / LORA_R)
LORA_EXPERT_LAYERS: list = []  # also adapt these layers' MoE experts (e.g. 7,15,23); empty = attention only
SEED = 42  # seeds LoRA init, the prompt stream and sampling
LOSS_TYPE = "dr_grpo"  # TRL loss_type (dr_grpo: token sum over a constant, no length bias)
SCALE_REWARDS = "none"  # TRL scale_rewards: none (Dr. GRPO), group or batch
ROUTER_AUX_LOSS_COEF = 0.0  # MoE load-balancing loss weight; 0 = off (the router stays frozen under LoRA)
BETA = 0.0  # KL penalty to the base model (0 = none, no reference model kept)
TEMPERATURE = 1.0  # sampling temperature for the completions
REASONING_EFFORT = "low"  # rewrite each prompt's "Reasoning:" line: low, medium, high; "" keeps the CSV's
GRADIENT_CHECKPOINTING = True  # recompute activations in backward (saves memory; generation still uses its KV cache)
DECODE_EXPERTS = "auto"  # auto/grouped_mm: keep grouped_mm experts when decoding; transformers: its batched_mm
DECODE_GRAPHS = False  # sample with graph_decode.py (static KV cache, decode steps as CUDA graphs); not yet timed
ATTN_IMPLEMENTATION = "auto"  # auto = flex_attention on CUDA (supports gpt-oss's sinks), eager on CPU
USE_VLLM = False  # generate with vLLM (colocated; needs requirements-gpu.txt's vllm) instead of transformers
VLLM_GPU_MEMORY_UTILIZATION = 0.35  # GPU memory fraction vLLM may take when USE_VLLM=1
LOGGING_STEPS = 1  # optimizer steps between metric lines / TensorBoard points
RESUME = ""  # "" = new run; "1" = continue from the newest checkpoint in OUT; or a checkpoint folder

_TINY_MODEL_ID = "tiny"
# Settings sized for the 20B that the tiny CPU run scales down, unless given on the command line. Why each:
# fewer and shorter completions and steps keep a CPU run to a few minutes (the tiny model's answer is ~23 tokens);
# a higher LR because the tiny model has to move within 30 steps; no gradient checkpointing because memory is no
# issue and it costs time; BETA>0 because invalid completions score NaN (no gradient at all), so nothing else keeps
# the tiny model's fragile answer format from drifting as LoRA moves (without it, validity fell to 0 by step ~25).
TINY_DEFAULTS = {
    "OUT": "runs/grpo-tiny",
    "NUM_GENERATIONS": 8,
    "GRADIENT_ACCUMULATION_STEPS": 2,
    "MAX_COMPLETION_LEN": 48,
    "TOTAL_STEPS": 30,
    "SAVE_STEPS": 10,
    "LR": 2e-3,
    "GRADIENT_CHECKPOINTING": False,
    "BETA": 0.04,
}
_CHECKPOINT_DIGITS = 6  # checkpoint-000010
_CHECKPOINT_RE = re.compile(r"^checkpoint-(\d+)$")


# ---------------------------------------------------------------------------------------------------------------
# Settings
# ---------------------------------------------------------------------------------------------------------------

class SettingsError(ValueError):
    """Settings that cannot work (together); main() prints it and exits 1."""


def default_settings(**overrides) -> dict:
    """This module's constants as a settings dict, with overrides (NAME=value); unknown names raise KeyError."""
    settings = constants_of(globals())
    unknown = sorted(set(overrides) - set(settings))
    if unknown:
        raise KeyError(f"unknown setting(s) {', '.join(unknown)}; valid: {', '.join(sorted(settings))}")
    settings.update(overrides)
    return settings


def apply_tiny_defaults(settings: dict, explicit: set[str]) -> dict:
    """For MODEL_ID=tiny, TINY_DEFAULTS replace the 20B-sized defaults not given explicitly; prints what changed."""
    if settings["MODEL_ID"] != _TINY_MODEL_ID:
        return settings
    changed = {name: value for name, value in TINY_DEFAULTS.items() if name not in explicit}
    if changed:
        say("MODEL_ID=tiny: tiny defaults " + ", ".join(f"{k}={v}" for k, v in changed.items())
            + " (20B defaults: " + ", ".join(f"{k}={settings[k]}" for k in changed) + ")")
    return {**settings, **changed}


def expert_layers(settings: dict) -> list[int]:
    layers = []
    for item in settings["LORA_EXPERT_LAYERS"]:
        try:
            layers.append(int(item))
        except ValueError:
            raise SettingsError(f"LORA_EXPERT_LAYERS: {item!r} is not a layer number") from None
    return layers


def batch_layout(settings: dict) -> dict:
    """How the completions of one optimizer step are generated and split; raises ValueError if they don't fit.

    completions_per_step = PROMPTS_PER_STEP * NUM_GENERATIONS * GRADIENT_ACCUMULATION_STEPS, all generated at once
    (TRL's generation batch); TRAIN_BATCH_SIZE of them per forward/backward, so the trainer's gradient
    accumulation (and TRL's steps_per_generation) is completions_per_step / TRAIN_BATCH_SIZE.
    """
    group = settings["NUM_GENERATIONS"]
    if group < 2:
        raise SettingsError("NUM_GENERATIONS must be at least 2 (GRPO compares completions of the same prompt)")
    if settings["PROMPTS_PER_STEP"] < 1 or settings["GRADIENT_ACCUMULATION_STEPS"] < 1:
        raise SettingsError("PROMPTS_PER_STEP and GRADIENT_ACCUMULATION_STEPS must be at least 1")
    per_step = settings["PROMPTS_PER_STEP"] * group * settings["GRADIENT_ACCUMULATION_STEPS"]
    micro = settings["TRAIN_BATCH_SIZE"] or settings["PROMPTS_PER_STEP"] * group
    if micro < 1 or per_step % micro:
        raise SettingsError(f"TRAIN_BATCH_SIZE={micro} must divide the {per_step} completions of an optimizer step "
                         "(PROMPTS_PER_STEP x NUM_GENERATIONS x GRADIENT_ACCUMULATION_STEPS)")
    return {"completions_per_step": per_step, "prompts_per_step": per_step // group, "train_batch_size": micro,
            "gradient_accumulation_steps": per_step // micro}


def check_settings(settings: dict) -> None:
    """Raises ValueError for settings that cannot work together (before anything slow happens)."""
    batch_layout(settings)
    expert_layers(settings)
    for name in ("MAX_PROMPT_LEN", "MAX_COMPLETION_LEN", "TOTAL_STEPS", "SAVE_STEPS", "LORA_R", "LOGGING_STEPS"):
        if settings[name] < 1:
            raise SettingsError(f"{name} must be at least 1, got {settings[name]}")
    if settings["PROMPT_TOO_LONG"] not in ("error", "skip"):
        raise SettingsError(f"PROMPT_TOO_LONG must be 'error' or 'skip', got {settings['PROMPT_TOO_LONG']!r}")
    if settings["SCALE_REWARDS"] not in ("none", "group", "batch"):
        raise SettingsError(f"SCALE_REWARDS must be none, group or batch, got {settings['SCALE_REWARDS']!r}")
    if settings["DECODE_EXPERTS"] not in ("auto", "grouped_mm", "transformers"):
        raise SettingsError("DECODE_EXPERTS must be auto, grouped_mm or transformers, "
                            f"got {settings['DECODE_EXPERTS']!r}")
    if settings["DECODE_GRAPHS"] and settings["USE_VLLM"]:
        raise SettingsError("DECODE_GRAPHS and USE_VLLM both choose how completions are generated; set one")
    if settings["REASONING_EFFORT"] not in ("", "low", "medium", "high"):
        raise SettingsError(f"REASONING_EFFORT must be low, medium, high or '', got {settings['REASONING_EFFORT']!r}")


# ---------------------------------------------------------------------------------------------------------------
# Model, tokenizer, LoRA
# ---------------------------------------------------------------------------------------------------------------

def on_cuda() -> bool:
    import torch

    return torch.cuda.is_available()


def attention_implementation(requested: str = "auto", cuda: bool | None = None) -> str:
    """flex_attention on CUDA (it supports gpt-oss's attention sinks; sdpa does not), eager on CPU."""
    if requested != "auto":
        return requested
    return "flex_attention" if (on_cuda() if cuda is None else cuda) else "eager"


def model_dtype(cuda: bool | None = None):
    """bf16 on CUDA; float32 on CPU, where bf16 matmuls are slow and the tiny model is small."""
    import torch

    return torch.bfloat16 if (on_cuda() if cuda is None else cuda) else torch.float32


def resolve_model_path(model_id: str) -> str:
    """MODEL_ID as from_pretrained takes it; "tiny" builds (once, on rank 0 first) and returns its folder."""
    if model_id == _TINY_MODEL_ID:
        from tes_grpo.tiny_model import ensure_tiny_checkpoint

        if is_main_process():
            path = ensure_tiny_checkpoint()
            wait_for_everyone()
        else:
            wait_for_everyone()  # rank 0 builds it; the others then find it cached
            path = ensure_tiny_checkpoint()
        return str(path)
    return model_id


def model_device_map(cuda: bool):
    """Where from_pretrained puts the weights: this process's GPU; on CPU for FSDP (accelerate shards them onto the
    GPUs; with fsdp_cpu_ram_efficient_loading only rank 0 holds real weights) and on machines without a GPU."""
    if not cuda or uses_fsdp():
        return None
    return {"": local_rank()} if process_count() > 1 else "cuda"


def loads_weights_here(cuda: bool) -> bool:
    """False on the ranks > 0 of an FSDP run on GPUs: FSDP broadcasts rank 0's weights to them while sharding
    (fsdp_cpu_ram_efficient_loading), so they need the model's structure only, not a CPU copy of its weights
    (transformers 5.x would otherwise load the whole checkpoint in every process: 8 x 218 GiB for gpt-oss-120b)."""
    return not (cuda and uses_fsdp() and process_count() > 1 and process_rank() != 0)


def empty_policy_model(path: str, dtype, attn: str):
    """The dequantized model's structure with its parameters on the meta device (buffers such as the rotary
    frequencies are real: FSDP does not broadcast non-persistent buffers)."""
    from accelerate import init_empty_weights
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.from_pretrained(path)
    if getattr(config, "quantization_config", None) is not None:
        del config.quantization_config  # as after Mxfp4Config(dequantize=True): plain bf16 experts
    with init_empty_weights(include_buffers=False):
        model = AutoModelForCausalLM.from_config(config, dtype=dtype, attn_implementation=attn)
    model.config.use_cache = True
    return model


def give_trainable_weights_storage(model) -> int:
    """Moves trainable parameters left on the meta device (the LoRA weights PEFT adds to an empty_policy_model) to
    uninitialised CPU memory; FSDP overwrites them with rank 0's values while sharding. Returns how many moved.

    Needed because accelerate maps the optimizer's parameters to their sharded copies by data_ptr(), which is 0 for
    every meta tensor: left on meta, all LoRA weights would map to one tensor and never be trained on that rank.
    The frozen base weights stay on meta (they are not in the optimizer).
    """
    import torch

    moved = 0
    for module in model.modules():
        for name, param in list(module.named_parameters(recurse=False)):
            if param.requires_grad and param.is_meta:
                setattr(module, name, torch.nn.Parameter(torch.empty_like(param, device="cpu"), requires_grad=True))
                moved += 1
    return moved


def load_policy_model(model_id: str, attn_implementation: str = "auto", dtype=None):
    """Loads an MXFP4 gpt-oss checkpoint dequantized (`Mxfp4Config(dequantize=True)`) for LoRA training.

    model_id: hub id, local folder, or "tiny". dtype defaults to model_dtype(); attention to
    attention_implementation(). Returns the transformers model (on the GPU when there is one; under FSDP on CPU
    on rank 0 and without weights on the other ranks, see loads_weights_here).
    """
    from transformers import AutoModelForCausalLM, Mxfp4Config

    path = resolve_model_path(model_id)
    attn = attention_implementation(attn_implementation)
    dtype = dtype or model_dtype()
    cuda = on_cuda()
    if not loads_weights_here(cuda):
        return empty_policy_model(path, dtype, attn)
    device_map = model_device_map(cuda)
    where = "cpu" if device_map is None else f"cuda:{local_rank()}"
    if cuda and device_map is None:
        where += ", then sharded onto the GPUs by FSDP"
    say(f"loading {path} with Mxfp4Config(dequantize=True) as {str(dtype).replace('torch.', '')}, "
        f"attention {attn}, on {where}")
    model = AutoModelForCausalLM.from_pretrained(
        path, quantization_config=Mxfp4Config(dequantize=True), dtype=dtype, attn_implementation=attn,
        device_map=device_map)
    # Generation must keep its KV cache even though gradient checkpointing is on for training (see build_grpo_config).
    model.config.use_cache = True
    return model


def load_policy_tokenizer(model_id: str):
    """The checkpoint's own tokenizer when the folder has one, else gpt_oss_tokenizer's (same vocabulary)."""
    from transformers import AutoTokenizer

    path = resolve_model_path(model_id)
    if (Path(path) / "tokenizer.json").is_file():
        return AutoTokenizer.from_pretrained(path)
    from tes_grpo.gpt_oss_tokenizer import load_tokenizer, tokenizer_source

    say(f"tokenizer: {tokenizer_source()} (no tokenizer.json in {path})")
    return load_tokenizer()


def build_lora_config(r: int, alpha: int, expert_layer_ids=()):
    """LoRA on every Linear layer (gpt-oss: q/k/v/o projections) plus, optionally, chosen layers' MoE experts.

    The experts are 3-D parameters (GptOssExperts.gate_up_proj [E, H, 2I], down_proj [E, I, H]), not Linear
    layers, so PEFT reaches them through `target_parameters` (PEFT >= 0.17; its ParamWrapper needs dropout 0).
    """
    from peft import LoraConfig

    target_parameters = [f"layers.{i}.mlp.experts.{name}" for i in expert_layer_ids
                         for name in ("gate_up_proj", "down_proj")]
    return LoraConfig(r=r, lora_alpha=alpha, lora_dropout=0.0, bias="none", task_type="CAUSAL_LM",
                      target_modules="all-linear", target_parameters=target_parameters or None)


# ---------------------------------------------------------------------------------------------------------------
# Data
# ---------------------------------------------------------------------------------------------------------------

def load_training_data(settings: dict, tokenizer):
    """The checked training rows (data_reward.load_training_frames), reasoning effort set, long prompts handled."""
    from data_reward import apply_reasoning_effort, check_prompt_lengths, load_training_frames

    frame = load_training_frames(settings["DATA_DIR"], settings["EVAL_DIR"])
    files = frame["source"].str.rpartition(":")[0].nunique()
    say(f"training data: {len(frame)} prompts from {files} file(s) under {settings['DATA_DIR']} "
        f"({settings['EVAL_DIR']} left out)")
    frame = apply_reasoning_effort(frame, settings["REASONING_EFFORT"])
    return check_prompt_lengths(frame, tokenizer, settings["MAX_PROMPT_LEN"], settings["PROMPT_TOO_LONG"])


def build_stream(frame, settings: dict, processes: int | None = None):
    """StepStream over the rows, one draw of distinct prompts per optimizer step across all processes.

    Every process builds the same stream (same seed); accelerate hands each a contiguous slice of each generation
    batch, so the processes train different prompts and each prompt's NUM_GENERATIONS completions stay together.
    """
    from data_reward import RECORD_COLUMNS
    from step_stream import StepStream

    processes = process_count() if processes is None else processes
    steps = settings["GRADIENT_ACCUMULATION_STEPS"] * processes
    try:
        return StepStream(frame, settings["PROMPTS_PER_STEP"], seed=settings["SEED"], columns=RECORD_COLUMNS,
                          steps_per_draw=steps)
    except ValueError as err:
        raise SettingsError(f"{err} (PROMPTS_PER_STEP x GRADIENT_ACCUMULATION_STEPS x {processes} process(es))") \
            from None


def build_train_dataset(frame, settings: dict, processes: int | None = None):
    """build_stream's stream as the `datasets.IterableDataset` TRL needs."""
    return build_stream(frame, settings, processes).to_iterable_dataset()


# ---------------------------------------------------------------------------------------------------------------
# Trainer
# ---------------------------------------------------------------------------------------------------------------

def build_grpo_config(settings: dict, cuda: bool | None = None):
    """TRL 1.16 GRPOConfig for the settings (only options TRL 1.16 has; see the notes inline)."""
    from trl import GRPOConfig

    cuda = on_cuda() if cuda is None else cuda
    layout = batch_layout(settings)
    out = Path(settings["OUT"])
    vllm = {}
    if settings["USE_VLLM"]:
        vllm = {"use_vllm": True, "vllm_mode": "colocate",
                "vllm_gpu_memory_utilization": settings["VLLM_GPU_MEMORY_UTILIZATION"],
                "vllm_max_model_length": settings["MAX_PROMPT_LEN"] + settings["MAX_COMPLETION_LEN"]}
    return GRPOConfig(
        output_dir=str(out),
        max_steps=settings["TOTAL_STEPS"],  # required: the stream has no length
        per_device_train_batch_size=layout["train_batch_size"],
        gradient_accumulation_steps=layout["gradient_accumulation_steps"],
        steps_per_generation=layout["gradient_accumulation_steps"],  # one generation batch per optimizer step
        num_generations=settings["NUM_GENERATIONS"],
        max_completion_length=settings["MAX_COMPLETION_LEN"],
        temperature=settings["TEMPERATURE"],
        # TRL disables gradient checkpointing around generate(); use_cache=True makes generate() keep a KV cache
        # whatever model.config.use_cache says (without it, decoding re-runs the whole prefix every token).
        generation_kwargs={"use_cache": True},
        shuffle_dataset=False,  # StepStream is already random; shuffling would read 1000 rows ahead
        dataloader_num_workers=0,
        dataloader_pin_memory=cuda,
        learning_rate=settings["LR"],
        lr_scheduler_type=settings["LR_SCHEDULER"],
        warmup_steps=int(settings["WARMUP_RATIO"] * settings["TOTAL_STEPS"]),
        loss_type=settings["LOSS_TYPE"],
        scale_rewards=settings["SCALE_REWARDS"],
        beta=settings["BETA"],
        router_aux_loss_coef=settings["ROUTER_AUX_LOSS_COEF"],
        seed=settings["SEED"],
        bf16=cuda,
        use_cpu=not cuda,  # on a machine without a GPU, several processes (accelerate launch) then use gloo
        gradient_checkpointing=settings["GRADIENT_CHECKPOINTING"],
        gradient_checkpointing_kwargs={"use_reentrant": False} if settings["GRADIENT_CHECKPOINTING"] else None,
        logging_steps=settings["LOGGING_STEPS"],
        report_to=["tensorboard"],
        save_strategy="steps",
        save_steps=settings["SAVE_STEPS"],
        save_total_limit=settings["KEEP_CHECKPOINTS"] or None,
        disable_tqdm=True,  # ProgressLineCallback prints one line per step instead
        log_completions=False,  # data_reward writes the full completion log
        **vllm,
    )


def _completion_positions_only(original):
    def use_compact_scoring(device):
        return device.type == "cpu" or original(device)

    use_compact_scoring.wraps_original = original
    return use_compact_scoring


def score_only_completion_tokens_on_cpu() -> bool:
    """Makes TRL 1.16's fused LM head score only completion positions on CPU too, as it does on CUDA.

    TRL picks "compact" scoring (log-probs only where labels are set, i.e. the completion tokens) only when Triton
    runs on the device; on CPU it pushes every prompt position through the 201,088-token head, forward and
    backward, which makes a CPU step minutes long for ~1,300-token prompts. The result is the same either way
    (prompt positions are masked out afterwards). Patches `trl.trainer.utils._use_triton` for CPU devices only;
    the kernels themselves keep TRL's own CPU fallback. Returns False (and says so) if this TRL lacks the hook.
    """
    import trl.trainer.utils as trl_utils

    current = getattr(trl_utils, "_use_triton", None)
    if current is None:
        say("note: this TRL has no trl.trainer.utils._use_triton; CPU steps score every prompt position")
        return False
    if not hasattr(current, "wraps_original"):
        trl_utils._use_triton = _completion_positions_only(current)
        say("CPU: TRL's fused LM head set to score completion positions only (as on CUDA)")
    return True


def quiet_all_rewards_none_warning() -> None:
    """Drops the warnings a step with no valid completion causes, which would flood the console every step.

    TRL's "All reward functions returned None" prints a whole 1,300-token prompt; TensorBoard's "attempting to log a
    value of None" fires for each reward metric that TRL logs as None. Invalid completions are expected here (NaN
    reward by design); their share is logged as action/valid_fraction and the progress line shows "reward nan".
    """
    import logging

    logging.getLogger("trl.trainer.grpo_trainer").addFilter(AllRewardsNoneFilter())
    logging.getLogger("transformers.integrations.integration_utils").addFilter(AllRewardsNoneFilter())


class AllRewardsNoneFilter:
    def filter(self, record) -> bool:
        message = record.getMessage()
        if "All reward functions returned None" in message:
            return False
        # TensorBoard's complaint about a None reward metric (other None metrics still warn)
        return not ('log a value of "None"' in message and "reward" in message)


def keep_grouped_mm_experts_for_decode(model) -> bool:
    """Stops transformers' generate() from switching grouped_mm experts to batched_mm for decoding (on GPUs).

    batched_mm gathers every token's expert weights: fine for a few sequences, but GRPO decodes 64 at once, where
    it ran out of memory on an H100 (see issue 3). Returns whether there was a switch to turn off.
    """
    import contextlib

    inner = model.get_base_model() if hasattr(model, "get_base_model") else model
    if not hasattr(inner, "_optimize_model_for_decode"):
        say("note: this transformers has no decode-time experts switch; nothing to keep")
        return False
    inner._optimize_model_for_decode = contextlib.nullcontext
    return True


def apply_decode_experts(model, mode: str) -> None:
    if mode not in ("auto", "grouped_mm", "transformers"):
        raise SettingsError(f"DECODE_EXPERTS must be auto, grouped_mm or transformers, got {mode!r}")
    if mode == "transformers":
        say("decoding experts: transformers' choice (batched_mm on GPUs)")
    elif keep_grouped_mm_experts_for_decode(model):
        say("decoding experts: grouped_mm kept for decoding (DECODE_EXPERTS)")


def apply_decode_graphs(model, enabled: bool, cuda: bool, sharded: bool = False) -> bool:
    """Routes the model's generate() through graph_decode.GraphDecodeGenerate (DECODE_GRAPHS); returns whether it did.

    Not under FSDP: a captured step cannot gather sharded weights. On CPU the same decode steps run without graphs.
    """
    if not enabled:
        return False
    if sharded:
        raise SettingsError("DECODE_GRAPHS cannot run under FSDP (every decode step gathers sharded weights); use "
                            "configs/accelerate/ddp.yaml or DECODE_GRAPHS=0")
    from tes_grpo.graph_decode import GraphDecodeGenerate, causal_lm

    inner = causal_lm(model)
    if not isinstance(inner.generate, GraphDecodeGenerate):
        inner.generate = GraphDecodeGenerate(inner, inner.generate, say=say)
    say("decoding: graph_decode.py, static KV cache and "
        + ("one CUDA graph per decode step (DECODE_GRAPHS)" if cuda
           else "no GPU, so its decode steps run eagerly, without CUDA graphs (DECODE_GRAPHS)"))
    return True


class SyncedGenerate:
    """Wraps a model's generate() to pass synced_gpus=True: under FSDP every process must run the same number of
    forward passes (each one gathers the sharded weights), so a process whose completions all ended keeps stepping
    until every process is done. transformers sets this itself only for its own FSDP, not for accelerate's."""

    def __init__(self, generate):
        self.generate = generate

    def __call__(self, *args, **kwargs):
        kwargs.setdefault("synced_gpus", True)
        return self.generate(*args, **kwargs)


def sync_generation_across_processes(model, sharded: bool) -> bool:
    """Makes generate() keep all processes in step when FSDP shards the weights; returns whether it did."""
    if not (sharded and process_count() > 1):
        return False
    inner = model.get_base_model() if hasattr(model, "get_base_model") else model
    if not isinstance(inner.generate, SyncedGenerate):
        inner.generate = SyncedGenerate(inner.generate)
    say("FSDP: generate() runs with synced_gpus=True (processes step together until all completions end)")
    return True


def set_completion_log_env(out: Path, steps_per_generation: int, log_path: str | None = None) -> Path:
    """Points data_reward's completion log at log_path (default OUT/completions.csv) for this process."""
    path = Path(log_path) if log_path else out / "completions.csv"
    os.environ["GRPO_COMPLETION_LOG_PATH"] = str(path)
    os.environ["GRPO_STEPS_PER_GENERATION"] = str(steps_per_generation)
    return path


def build_trainer(settings: dict, model, tokenizer, train_dataset, callbacks=(), completion_log_path=None):
    """GRPOTrainer wired with reward_fn, LoRA (build_lora_config), the stream and this module's callbacks.

    `model` is a loaded (not yet PEFT-wrapped) gpt-oss; the trainer adds the LoRA adapter. Also points the
    completion log (data_reward) and TensorBoard at OUT. Model loading stays outside, so a benchmark can pass any
    gpt-oss-shaped model.
    """
    from trl import GRPOTrainer

    from data_reward import reward_fn

    check_settings(settings)
    out = Path(settings["OUT"])
    out.mkdir(parents=True, exist_ok=True)
    args = build_grpo_config(settings)
    log_path = set_completion_log_env(out, args.steps_per_generation, completion_log_path)
    os.environ["TENSORBOARD_LOGGING_DIR"] = str(out / "tensorboard")
    lora = build_lora_config(settings["LORA_R"], settings["LORA_ALPHA"], expert_layers(settings))
    apply_decode_experts(model, settings["DECODE_EXPERTS"])
    if not on_cuda():
        score_only_completion_tokens_on_cpu()
    quiet_all_rewards_none_warning()
    trainer = GRPOTrainer(model=model, reward_funcs=reward_fn, args=args, train_dataset=train_dataset,
                          processing_class=tokenizer, peft_config=lora,
                          callbacks=[JsonlMetricsCallback(out / "metrics.jsonl"), ProgressLineCallback(),
                                     ZeroPaddedCheckpointNames(), *callbacks])
    if uses_fsdp() and not trainer.is_fsdp_enabled:
        say("note: the FSDP config has no effect without GPUs; accelerate runs plain data parallelism here")
    sync_generation_across_processes(trainer.model, trainer.is_fsdp_enabled)
    apply_decode_graphs(trainer.model, settings["DECODE_GRAPHS"], on_cuda(), trainer.is_fsdp_enabled)
    give_trainable_weights_storage(trainer.model)
    from transformers.trainer_callback import PrinterCallback

    trainer.remove_callback(PrinterCallback)  # ProgressLineCallback prints a compact line instead of the raw dict
    layout = batch_layout(settings)
    processes = process_count()
    say(f"batch: {layout['completions_per_step']} completions per optimizer step = {layout['prompts_per_step']} "
        f"prompts x {settings['NUM_GENERATIONS']} generations, generated together; {layout['train_batch_size']} "
        f"per forward/backward x {layout['gradient_accumulation_steps']} accumulation steps"
        + (f" (per process; the {processes} processes train {processes * layout['completions_per_step']} "
           f"completions of {processes * layout['prompts_per_step']} distinct prompts per optimizer step)"
           if processes > 1 else ""))
    say(f"completion log: {log_path}" if os.environ.get("GRPO_LOG_COMPLETIONS", "1").lower()
        not in ("0", "false", "no", "off") else "completion log: off (GRPO_LOG_COMPLETIONS)")
    trainable = sum(p.numel() for p in trainer.model.parameters() if p.requires_grad)
    say(f"LoRA r={settings['LORA_R']} alpha={settings['LORA_ALPHA']} on all-linear"
        + (f" + experts of layers {expert_layers(settings)}" if settings["LORA_EXPERT_LAYERS"] else "")
        + f": {trainable / 1e6:.2f} M trainable parameters")
    return trainer


# ---------------------------------------------------------------------------------------------------------------
# Callbacks: metrics file, progress lines, checkpoint names
# ---------------------------------------------------------------------------------------------------------------

def _callback_base():
    from transformers import TrainerCallback

    return TrainerCallback


class JsonlMetricsCallback(_callback_base()):
    """Appends every logged metrics dict, with its step, to a JSON-lines file (main process only)."""

    def __init__(self, path: str | os.PathLike):
        self.path = Path(path)

    def on_log(self, args, state, control, logs=None, **kwargs):
        if not state.is_world_process_zero or not logs:
            return
        self.path.parent.mkdir(parents=True, exist_ok=True)
        record = {"step": state.global_step, "time": round(time.time(), 3), **logs}
        with open(self.path, "a", encoding="utf-8") as handle:
            handle.write(json.dumps(record, default=float) + "\n")


def format_metric(value) -> str:
    """Short text for a logged metric; TRL logs None when every reward of a step was NaN."""
    if value is None or (isinstance(value, float) and value != value):
        return "nan"
    return f"{value:.3g}" if isinstance(value, (int, float)) else str(value)


class ProgressLineCallback(_callback_base()):
    """One line per logged step: step, reward, valid and optimal fractions, loss, seconds per step."""

    def __init__(self):
        self.started = None
        self.first_step = 0

    def on_train_begin(self, args, state, control, **kwargs):
        self.started = time.time()
        self.first_step = state.global_step

    def on_log(self, args, state, control, logs=None, **kwargs):
        if not state.is_world_process_zero or not logs or "reward" not in logs:
            return
        done = max(1, state.global_step - self.first_step)
        per_step = (time.time() - self.started) / done
        parts = [f"step {state.global_step}/{state.max_steps}"]
        for key, label in (("reward", "reward"), ("action/valid_fraction", "valid"), ("action/optimal_fraction",
                           "optimal"), ("loss", "loss"), ("completions/mean_length", "len")):
            if key in logs:
                parts.append(f"{label} {format_metric(logs[key])}")
        parts.append(f"{per_step:.1f} s/step")
        print("  ".join(parts), flush=True)


class ZeroPaddedCheckpointNames(_callback_base()):
    """Renames the Trainer's checkpoint-N folders to checkpoint-00000N, so they sort by name.

    Safe for resuming: transformers finds the newest checkpoint by the integer after "checkpoint-" (int("000010")
    is 10), and rotation (save_total_limit) globs "checkpoint-*" the same way. On several processes each one writes
    its own RNG state (rng_state_<rank>.pth) into the folder, so all meet before rank 0 renames it.
    """

    def on_save(self, args, state, control, **kwargs):
        wait_for_everyone()
        if state.is_world_process_zero:
            self.rename(Path(args.output_dir), state.global_step)
        wait_for_everyone()

    @staticmethod
    def rename(output_dir: Path, step: int) -> None:
        plain = output_dir / f"checkpoint-{step}"
        padded = output_dir / f"checkpoint-{step:0{_CHECKPOINT_DIGITS}d}"
        if plain == padded or not plain.is_dir():
            return
        if padded.exists():
            shutil.rmtree(padded)  # a stale copy of the same step from an earlier attempt
        os.replace(plain, padded)


# ---------------------------------------------------------------------------------------------------------------
# Run folder: resume, logs
# ---------------------------------------------------------------------------------------------------------------

def checkpoints_in(out: Path) -> list[tuple[int, Path]]:
    """(step, folder) of every checkpoint in out, oldest first."""
    found = []
    if out.is_dir():
        for child in out.iterdir():
            match = _CHECKPOINT_RE.match(child.name)
            if match and child.is_dir() and (child / "trainer_state.json").is_file():
                found.append((int(match.group(1)), child))
    return sorted(found)


def resume_checkpoint(settings: dict) -> Path | None:
    """The checkpoint to resume from (RESUME), or None for a new run; refuses to start over an existing run."""
    out = Path(settings["OUT"])
    resume = str(settings["RESUME"]).strip()
    existing = checkpoints_in(out)
    if resume.lower() in ("", "0", "false", "no", "off"):
        leftovers = [name for name in ("metrics.jsonl", "completions.csv", "adapter_model.safetensors")
                     if (out / name).exists()]
        if existing or leftovers:
            raise InputError(out, "already holds a run (" + ", ".join([p.name for _, p in existing[-1:]] + leftovers)
                             + "); pass --RESUME=1 to continue it, or choose another --OUT")
        return None
    if resume.lower() in ("1", "true", "yes", "on", "last"):
        if not existing:
            raise InputError(out, "RESUME=1 but there is no checkpoint-* folder to resume from")
        return existing[-1][1]
    path = Path(resume)
    if not (path / "trainer_state.json").is_file():
        raise InputError(path, "RESUME names a folder without trainer_state.json (not a checkpoint)")
    return path


def checkpoint_processes(checkpoint: Path) -> int | None:
    """How many processes wrote the checkpoint: one rng_state_<rank>.pth each, rng_state.pth for one; None if
    it has no RNG state."""
    ranked = list(checkpoint.glob("rng_state_*.pth"))
    if ranked:
        return len(ranked)
    return 1 if (checkpoint / "rng_state.pth").is_file() else None


def check_resume_processes(checkpoint: Path, processes: int) -> None:
    """A run resumes with the number of processes that wrote its checkpoint: the prompt stream's draws and every
    rank's RNG state depend on it."""
    wrote = checkpoint_processes(checkpoint)
    if wrote is not None and wrote != processes:
        how = f"accelerate launch --num_processes {wrote}" if wrote > 1 else "python train_grpo.py"
        raise InputError(checkpoint, f"was written by {wrote} process(es), this run has {processes}; resume it "
                         f"with {wrote} ({how})")


def checkpoint_step(checkpoint: Path) -> int:
    return int(json.loads((checkpoint / "trainer_state.json").read_text(encoding="utf-8"))["global_step"])


def drop_log_rows_after(out: Path, step: int, completion_log: Path) -> None:
    """On resume, removes metrics and completion-log rows of steps after the checkpoint (they will be redone)."""
    import pandas as pd

    from tes_grpo.fileio import write_csv_atomic

    metrics = out / "metrics.jsonl"
    if metrics.is_file():
        lines = metrics.read_text(encoding="utf-8").splitlines()
        kept = [line for line in lines if line.strip() and json.loads(line).get("step", 0) <= step]
        if len(kept) != len(lines):
            atomic_write_text(metrics, "".join(line + "\n" for line in kept))
            say(f"resume: dropped {len(lines) - len(kept)} metrics line(s) after step {step}")
    if completion_log.is_file() and completion_log.stat().st_size > 0:
        frame = pd.read_csv(completion_log, keep_default_na=False, dtype=str)
        kept_rows = frame[frame["step"].astype(int) <= step]
        if len(kept_rows) != len(frame):
            write_csv_atomic(kept_rows, completion_log)
            say(f"resume: dropped {len(frame) - len(kept_rows)} completion-log row(s) after step {step}")


def run_summary(settings: dict, layout: dict, extra: dict) -> dict:
    """The resolved settings plus what was derived from them, as written to train_config.json."""
    import peft
    import torch
    import transformers
    import trl

    return {**settings, "derived": {**layout, **extra, "processes": process_count(), "versions": {
        "python": sys.version.split()[0], "torch": torch.__version__, "transformers": transformers.__version__,
        "trl": trl.__version__, "peft": peft.__version__}}}


def report_extras(settings: dict) -> None:
    """Says which optional GPU extras this run uses."""
    import importlib.util

    have = {name: importlib.util.find_spec(name) is not None for name in ("vllm", "kernels", "liger_kernel")}
    if settings["USE_VLLM"] and not have["vllm"]:
        raise SettingsError("USE_VLLM=1 needs vllm (pip install -r requirements-gpu.txt); it is not installed")
    say("generation: " + ("vLLM (colocated)" if settings["USE_VLLM"] else "transformers generate with KV cache")
        + "; optional extras installed: " + ", ".join(f"{k}={'yes' if v else 'no'}" for k, v in have.items())
        + " (kernels/liger are not used by this script)")


def check_visible_gpus(gpus: int | None = None) -> None:
    """One process must see one GPU: the Trainer would otherwise wrap the model in nn.DataParallel (TRL refuses it)."""
    if gpus is None:
        import torch

        gpus = torch.cuda.device_count()
    if process_count() == 1 and gpus > 1:
        raise SettingsError(f"{gpus} GPUs are visible to one process. Train on one of them with CUDA_VISIBLE_DEVICES=0 "
                            "python train_grpo.py ..., or on all of them with accelerate launch --config_file "
                            "configs/accelerate/ddp.yaml (or fsdp2.yaml) train_grpo.py ...")


def train(settings: dict, callbacks=()) -> Path:
    """Runs GRPO for the settings (already overridden and tiny-adjusted); returns OUT.

    callbacks: extra transformers TrainerCallbacks (tests use one to look at the model before and after).
    """
    check_settings(settings)
    out = Path(settings["OUT"])
    checkpoint = resume_checkpoint(settings)
    if checkpoint is not None:
        check_resume_processes(checkpoint, process_count())
    check_visible_gpus()
    start_process_group()
    report_extras(settings)
    model_path = resolve_model_path(settings["MODEL_ID"])
    tokenizer = load_policy_tokenizer(model_path)
    frame = load_training_data(settings, tokenizer)
    model = load_policy_model(model_path, settings["ATTN_IMPLEMENTATION"])
    dataset = build_train_dataset(frame, settings)
    # GRPO_COMPLETION_LOG_PATH from the environment overrides the default OUT/completions.csv.
    trainer = build_trainer(settings, model, tokenizer, dataset, callbacks=callbacks,
                            completion_log_path=os.environ.get("GRPO_COMPLETION_LOG_PATH") or None)
    completion_log = Path(os.environ["GRPO_COMPLETION_LOG_PATH"])
    extra = {"attn_implementation": model.config._attn_implementation, "dtype": str(model.dtype),
             "train_prompts": len(frame), "completion_log": str(completion_log)}
    if is_main_process():
        save_config(run_summary(settings, batch_layout(settings), extra), out / "train_config.json")
    if checkpoint is not None:
        step = checkpoint_step(checkpoint)
        if is_main_process():
            drop_log_rows_after(out, step, completion_log)
        say(f"resuming from {checkpoint} at step {step} of {settings['TOTAL_STEPS']}")
    trainer.train(resume_from_checkpoint=str(checkpoint) if checkpoint else None)
    trainer.save_model(str(out))  # adapter + tokenizer (every process takes part under FSDP; rank 0 writes)
    trainer.save_state()
    say(f"done: adapter, tokenizer and trainer state in {out}")
    return out


def main(argv: list[str] | None = None, callbacks=()) -> int:
    """Command-line entry: applies --NAME=value overrides (and tiny defaults), trains; returns the exit status."""
    argv = sys.argv[1:] if argv is None else argv
    # Overrides go into a copy of the module namespace: the module's defaults stay as written, so main() can run
    # twice in one process (tests, notebooks) and default_settings() always means the defaults.
    namespace = dict(globals())
    configure(namespace, argv)
    explicit = set(parse_overrides(argv, default_settings(), namespace.get("__annotations__", {})))
    settings = apply_tiny_defaults(default_settings(**{k: namespace[k] for k in explicit}), explicit)
    try:
        train(settings, callbacks)
    except (InputError, SettingsError) as err:
        print(f"error: {err}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
