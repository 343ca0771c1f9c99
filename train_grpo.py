"""GRPO + LoRA fine-tuning of gpt-oss on the TES datasets; leaves a LoRA adapter in a run folder under runs/.

    .venv/bin/python train_grpo.py --MODEL_ID=tiny     # embedded tiny gpt-oss on CPU, a few minutes (preset below)
    .venv/bin/python train_grpo.py                     # openai/gpt-oss-20b on one H100/H200: the reference recipe
    .venv/bin/python train_grpo.py --RESUME=1          # continue a killed run from its newest checkpoint
    .venv/bin/python train_grpo.py --help              # every setting with its default, and the tiny preset
    .venv/bin/accelerate launch --config_file configs/accelerate/ddp.yaml train_grpo.py    # several GPUs, one host
    .venv/bin/accelerate launch --config_file configs/accelerate/fsdp2.yaml train_grpo.py  # weights sharded (FSDP2)

The recipe (README "The recipe" says where each value comes from): the MXFP4 checkpoint's frozen experts stay
resident as MXFP4 and the rest loads in bf16 (EXPERTS), PEFT adds LoRA to every Linear layer (the attention
projections), `StepStream` draws the prompts, TRL's `GRPOTrainer` samples NUM_GENERATIONS completions per prompt
and scores each with `data_reward.reward_fn`. One optimizer step = PROMPTS_PER_STEP x NUM_GENERATIONS x
GRADIENT_ACCUMULATION_STEPS completions (64), generated as one batch (GENERATION_STEPS=k: k steps' in one), trained
TRAIN_BATCH_SIZE at a time ("auto": as many as the GPU's memory holds when every completion is at
MAX_COMPLETION_LEN, at most TRAIN_TOKENS_PER_PASS tokens; training/memory_plan.py). The trainer is
tes_grpo/training/trainer.py's GRPOTrainer subclass, which samples with the project's sampler and logs the
sampler-trainer gap every step (sampling_fidelity.py). Under `accelerate launch` with N processes these are per
process.

Environment (the seed's interface, read once here): GRPO_LOG_COMPLETIONS=0 turns the completion log off,
GRPO_COMPLETION_LOG_PATH=file.csv writes it elsewhere, GRPO_STEPS_PER_GENERATION=k generates every k micro-steps
instead of once per optimizer step (GENERATION_STEPS left at 1), GPT_OSS_TOKENIZER names the tokenizer folder
(unset: ../shared/gpt-oss-tokenizer beside the repo, else the Hub's openai/gpt-oss-20b; checked at start-up).

Evaluation (tes_grpo/run/evaluation.py): every EVAL_STEPS the policy answers EVAL_PROMPTS held-out prompts of
EVAL_DIR (EVAL_SAMPLES completions each) with the training sampler; the quantities of test_lora_adapter.py's report
are logged as eval_*, and BEST_METRIC picks the best checkpoint (`--ADAPTER_PATH=OUT_DIR/best` elsewhere).

Written to OUT_DIR (tes_grpo/run/run_folder.py says what each file is): train_config.json, metrics.jsonl (training
and evaluation rows), completions.csv (training only), best_checkpoint.json, training.png (reward, valid and optimal
share per step and at each evaluation), tensorboard/, checkpoint-000020-style folders every SAVE_STEPS and at each
evaluation, and at the end the adapter with its tokenizer, trainer_state.json and training_args.bin. Ctrl-C or
running out of memory says the step and how the run goes on.
"""

from __future__ import annotations

import math
import os
import sys
from pathlib import Path

from tes_grpo.run import choices
from tes_grpo.run.fileio import InputError
from tes_grpo.run.presets import presets_for
from tes_grpo.run.processes import interrupts_held, is_main_process, process_count, say
from tes_grpo.run.script_config import ConfigError, Settings, SettingsError, resolve, save_config
from tes_grpo.run.train_settings import check_plain_settings, expert_layers, read_environment
from tes_grpo.task.harmony import REASONING_EFFORTS as _EFFORTS

MODEL_ID = "openai/gpt-oss-20b"  # hub id or local folder of an MXFP4 gpt-oss checkpoint; "tiny" = embedded tiny model
OUT_DIR = "runs/grpo-gpt-oss-20b"  # run folder: adapter, checkpoints, train_config.json, metrics.jsonl, completions.csv
DATA_DIR = "data"  # training CSVs: every *_harmony.csv below it, EVAL_DIR left out
EVAL_DIR = "data/eval"  # evaluation split: never trained on, evaluated every EVAL_STEPS
REASONING_EFFORT = "medium"  # each prompt's "Reasoning:" line: low, medium (as shipped), high; "" keeps the CSV's
MAX_PROMPT_LEN = 2048  # tokens; longer prompts fail at load or are skipped (PROMPT_TOO_LONG), never cut
PROMPT_TOO_LONG = "error"  # "error": stop naming file and row; "skip": drop them and print how many
MAX_COMPLETION_LEN = 4000  # tokens generated per completion; one cut here scores INVALID_REWARD
NUM_GENERATIONS = 16  # completions sampled per prompt (the GRPO group)
PROMPTS_PER_STEP = 1  # distinct prompts per micro-step (per gradient-accumulation slot)
GRADIENT_ACCUMULATION_STEPS = 4  # micro-steps per optimizer step (one generation batch feeds them all)
GENERATION_STEPS = 1  # optimizer steps per generation batch (2, 4: faster decoding, later steps slightly off-policy)
TRAIN_BATCH_SIZE = "auto"  # completions per forward/backward: a number, or auto = most that memory and the cap allow
TRAIN_TOKENS_PER_PASS = 40000  # auto's cap: completions x (longest prompt + MAX_COMPLETION_LEN) tokens a pass
MEMORY_BUDGET_GB = 0.0  # GiB the run may hold on the GPU, weights included (24 = a 24 GB card); 0 = all it has free
TOTAL_STEPS = 200  # optimizer steps (the stream is endless, so this sets the run length)
SAVE_STEPS = 20  # optimizer steps between checkpoints
KEEP_CHECKPOINTS = 0  # newest checkpoints kept in OUT_DIR (older ones deleted); 0 = keep all (r=4 adapters are small)
EVAL_STEPS = "auto"  # optimizer steps between evaluations (each also saves a checkpoint); auto = SAVE_STEPS; 0 = off
EVAL_PROMPTS = 4  # prompts of EVAL_DIR an evaluation samples (spread evenly over the split, the same every time)
EVAL_SAMPLES = 16  # completions per evaluation prompt (4 x 16: the shape and cost of one training generation batch)
EVAL_AT_START = True  # also evaluate the base model at step 0, so the curve starts from it
BEST_METRIC = "eval_action/mean_reward"  # evaluation quantity that picks the best checkpoint (best_checkpoint.json)
LR = 5e-5  # AdamW learning rate for the LoRA weights
LR_SCHEDULER = "linear"  # transformers scheduler: linear (decays to 0 at TOTAL_STEPS), constant, cosine, ...
WARMUP_RATIO = 0.0  # fraction of TOTAL_STEPS with linear learning-rate warm-up
LORA_R = 4  # LoRA rank
LORA_ALPHA = 8  # LoRA scaling numerator (scale = LORA_ALPHA / LORA_R)
LORA_EXPERT_LAYERS: list = []  # also adapt these layers' MoE experts (e.g. 7,15,23); empty = attention only
SEED = 42  # seeds LoRA init, the prompt stream and sampling
LOSS_TYPE = "dr_grpo"  # TRL loss_type (dr_grpo: token sum over a constant, no length bias)
SCALE_REWARDS = "none"  # TRL scale_rewards: none (Dr. GRPO), group or batch
BETA = 0.0  # KL penalty to the base model (0 = none, no reference model kept)
INVALID_REWARD = 0.0  # reward of an invalid or truncated completion; nan = leave it out (no gradient), as TRL 1.x does
TEMPERATURE = 1.0  # sampling temperature for the completions
IMPORTANCE_SAMPLING = "off"  # sampler-trainer gap correction: off, token_truncate, token_mask, sequence_* (TRL's)
IMPORTANCE_SAMPLING_CAP = 3.0  # upper bound of pi_train/pi_sampler there (TRL's vllm_importance_sampling_clip_max)
ROUTER_AUX_LOSS_COEF = 0.0  # MoE load-balancing loss weight; 0 = off (the router stays frozen under LoRA)
GRADIENT_CHECKPOINTING = True  # recompute activations in backward (saves memory; generation still uses its KV cache)
DECODE_GRAPHS = "auto"  # sample with graph_decode.py (static KV cache, CUDA graphs); auto = where it can run
DECODE_EXPERTS = "auto"  # graph_decode's experts: auto = the MXFP4 kernel on a GPU (fast_paths.py)
TRAIN_EXPERTS = "auto"  # training MoE elementwise work; auto = fused on a GPU with Triton (fast_paths.py)
TRAIN_GLUE = "auto"  # training norms, rotary, sinks, LoRA adds; auto = compiled on a GPU with Triton (fast_paths.py)
DECODE_LORA = "peft"  # graph_decode's LoRA: peft = in the trainer's order (exact policy); merged = faster, own rounding
DECODE_GLUE = "auto"  # graph_decode's norms, RoPE, sinks, adds: compiled = fused; auto = compiled on a GPU with Triton
EXPERTS = "auto"  # frozen MoE experts: auto = resident as MXFP4 (mxfp4_experts.py) unless LORA_EXPERT_LAYERS
ATTN_IMPLEMENTATION = "auto"  # auto = flex_attention on CUDA (supports gpt-oss's sinks), eager on CPU
USE_VLLM = False  # generate with vLLM (colocated; needs requirements-gpu.txt's vllm) instead of transformers
VLLM_GPU_MEMORY_UTILIZATION = 0.35  # GPU memory fraction vLLM may take when USE_VLLM=1
LOGGING_STEPS = 1  # optimizer steps between metric lines / TensorBoard points
REPORT_TO = ["tensorboard"]  # trackers besides metrics.jsonl: TRL's report_to names (wandb, trackio, mlflow...); none
RESUME = ""  # "" = new run; "1" = continue from the newest complete checkpoint in OUT_DIR; or a checkpoint folder

# MODEL_ID=tiny replaces these defaults unless given (printed at start, listed by --help): a few-minute CPU run on
# the embedded tiny gpt-oss. The table lives in tes_grpo/run/presets.py, shared with step_stream.py's preview; why its
# values were chosen is said there, and the runs behind them are in BENCHMARKS.md ("The tiny run's preset").
PRESETS = presets_for(globals())

# the settings with a fixed set of values (checked when resolved; --help lists them)
CHOICES = {
    "LR_SCHEDULER": ("linear", "cosine", "cosine_with_restarts", "polynomial", "constant", "constant_with_warmup",
                     "inverse_sqrt", "cosine_with_min_lr", "warmup_stable_decay"),  # transformers' SchedulerType
    "LOSS_TYPE": ("grpo", "bnpo", "dr_grpo", "dapo", "luspo", "cispo", "sapo", "vespo"),  # TRL 1.16's loss_type
    "SCALE_REWARDS": ("none", "group", "batch"),
    "PROMPT_TOO_LONG": ("error", "skip"),
    "REASONING_EFFORT": ("", *_EFFORTS),
    "IMPORTANCE_SAMPLING": choices.IS_MODES,
    "EXPERTS": choices.EXPERTS_CHOICES,
    "BEST_METRIC": tuple(choices.BEST_METRICS),
    **choices.FAST_PATHS,
}


# ---------------------------------------------------------------------------------------------------------------
# Settings: checked before anything slow, the batch layout derived from them
# ---------------------------------------------------------------------------------------------------------------

def default_settings(**overrides) -> Settings:
    """This module's constants as Settings with overrides applied (and the tiny preset when MODEL_ID=tiny)."""
    from tes_grpo.run.script_config import settings_from

    try:
        return settings_from(globals(), overrides, PRESETS)  # check_settings checks CHOICES
    except ConfigError as err:
        raise KeyError(str(err)) from None


def check_settings(s) -> None:
    """Raises SettingsError naming the setting and value for settings that cannot work (before anything slow)."""
    check_plain_settings(s, CHOICES)
    check_library_settings(s)


def check_library_settings(s) -> None:
    """The settings whose check asks the libraries (torch, TRL): the fast paths and the sampler-trainer correction."""
    from tes_grpo.sampling import sampling_fidelity
    from tes_grpo.training import fast_paths

    fast_paths.check_settings(s)
    problem = sampling_fidelity.correction_problem(s.IMPORTANCE_SAMPLING, s.IMPORTANCE_SAMPLING_CAP, s.LOSS_TYPE)
    if problem:
        raise SettingsError(problem)


# ---------------------------------------------------------------------------------------------------------------
# The recipe's pieces: data stream, LoRA, GRPOConfig, trainer
# ---------------------------------------------------------------------------------------------------------------

def read_training_data(s):
    """The checked training rows (data_reward.load_training_frames), reasoning effort set; no tokenizer needed."""
    from data_reward import apply_reasoning_effort, load_training_frames

    frame = load_training_frames(s.DATA_DIR, s.EVAL_DIR)
    files = frame["source"].str.rpartition(":")[0].nunique()
    say(f"training data: {len(frame)} prompts from {files} file(s) under {s.DATA_DIR} ({s.EVAL_DIR} left out)")
    return apply_reasoning_effort(frame, s.REASONING_EFFORT)


def load_training_data(s, tokenizer, frame=None):
    """read_training_data's rows (or `frame`, read already) with each prompt's length, long prompts handled."""
    from data_reward import check_prompt_lengths

    frame = read_training_data(s) if frame is None else frame
    return check_prompt_lengths(frame, tokenizer, s.MAX_PROMPT_LEN, s.PROMPT_TOO_LONG)


def load_eval_data(s, tokenizer):
    """The evaluation rows (data_reward.load_eval_frame), EVAL_PROMPTS of them spread over the split, prepared as
    the training rows are; None when evaluation is off (EVAL_STEPS=0)."""
    from data_reward import apply_reasoning_effort, check_prompt_lengths, load_eval_frame
    from tes_grpo.run.evaluation import eval_subset, evaluating

    if not evaluating(s):
        return None
    frame = eval_subset(load_eval_frame(s.EVAL_DIR), s.EVAL_PROMPTS, s.EVAL_DIR, say)
    frame = apply_reasoning_effort(frame, s.REASONING_EFFORT)
    return check_prompt_lengths(frame, tokenizer, s.MAX_PROMPT_LEN, s.PROMPT_TOO_LONG)


def build_stream(frame, s, processes: int | None = None):
    """StepStream over the rows, one draw of distinct prompts per generation batch across all processes: one
    optimizer step, or GENERATION_STEPS of them (every process builds the same stream; accelerate hands each a
    contiguous slice, so each prompt's group stays on one process, and TRL's shuffle of a generation batch across its
    steps mixes distinct prompts only)."""
    from data_reward import RECORD_COLUMNS
    from step_stream import StepStream

    processes = process_count() if processes is None else processes
    try:
        return StepStream(frame, s.PROMPTS_PER_STEP, seed=s.SEED, columns=RECORD_COLUMNS,
                          steps_per_draw=s.GRADIENT_ACCUMULATION_STEPS * processes * s.GENERATION_STEPS)
    except ValueError as err:
        raise SettingsError(f"{err} (PROMPTS_PER_STEP x GRADIENT_ACCUMULATION_STEPS x {processes} process(es) x "
                            f"GENERATION_STEPS={s.GENERATION_STEPS})") from None


def build_lora_config(r: int, alpha: float, expert_layer_ids=()):
    """LoRA on every Linear layer (gpt-oss: q/k/v/o projections) plus, optionally, chosen layers' MoE experts, which
    are 3-D parameters reached through PEFT's `target_parameters` (PEFT >= 0.17; its ParamWrapper needs dropout 0)."""
    from peft import LoraConfig

    target_parameters = [f"layers.{i}.mlp.experts.{name}" for i in expert_layer_ids
                         for name in ("gate_up_proj", "down_proj")]
    return LoraConfig(r=r, lora_alpha=alpha, lora_dropout=0.0, bias="none", task_type="CAUSAL_LM",
                      target_modules="all-linear", target_parameters=target_parameters or None)


def build_grpo_config(s, layout: dict, cuda: bool, evaluate: bool = False, first_run: bool = True):
    """TRL 1.16 GRPOConfig for the settings and batch layout; evaluate: with the evaluation settings (the trainer
    gets the evaluation rows), first_run: not resumed (step 0 is evaluated)."""
    from trl import GRPOConfig

    from tes_grpo.run import evaluation
    from tes_grpo.run.trackers import report_to

    vllm = {}
    if s.USE_VLLM:
        vllm = {"use_vllm": True, "vllm_mode": "colocate", "vllm_gpu_memory_utilization": s.VLLM_GPU_MEMORY_UTILIZATION,
                "vllm_max_model_length": s.MAX_PROMPT_LEN + s.MAX_COMPLETION_LEN,
                "vllm_importance_sampling_correction": False}  # sampling_fidelity measures and corrects every path
    # transformers 5.24 renamed gradient_checkpointing* to activation_checkpointing* (the old names warn); 5.17 has
    # only the old ones
    name = "activation" if "activation_checkpointing" in GRPOConfig.__dataclass_fields__ else "gradient"
    checkpointing = {f"{name}_checkpointing": s.GRADIENT_CHECKPOINTING,
                     f"{name}_checkpointing_kwargs": {"use_reentrant": False} if s.GRADIENT_CHECKPOINTING else None}
    return GRPOConfig(
        output_dir=str(s.OUT_DIR), max_steps=s.TOTAL_STEPS,  # max_steps is required: the stream has no length
        per_device_train_batch_size=layout["train_batch_size"],
        gradient_accumulation_steps=layout["gradient_accumulation_steps"],
        steps_per_generation=layout["steps_per_generation"],
        num_generations=s.NUM_GENERATIONS, max_completion_length=s.MAX_COMPLETION_LEN, temperature=s.TEMPERATURE,
        # TRL disables gradient checkpointing around generate(); use_cache=True makes generate() keep a KV cache
        # whatever model.config.use_cache says (without it, decoding re-runs the whole prefix every token).
        generation_kwargs={"use_cache": True},
        shuffle_dataset=False,  # StepStream is already random; shuffling would read 1000 rows ahead
        dataloader_num_workers=0, dataloader_pin_memory=cuda,
        learning_rate=s.LR, lr_scheduler_type=s.LR_SCHEDULER, warmup_steps=int(s.WARMUP_RATIO * s.TOTAL_STEPS),
        loss_type=s.LOSS_TYPE, scale_rewards=s.SCALE_REWARDS, beta=s.BETA, router_aux_loss_coef=s.ROUTER_AUX_LOSS_COEF,
        seed=s.SEED, bf16=cuda,
        ddp_broadcast_buffers=False,  # no buffer changes in training; resident MXFP4 experts are buffers (GiBs)
        use_cpu=not cuda,  # on a machine without a GPU, several processes (accelerate launch) then use gloo
        **checkpointing,
        logging_steps=s.LOGGING_STEPS, report_to=report_to(s.REPORT_TO) or "none",
        save_strategy="steps", save_steps=s.SAVE_STEPS, save_total_limit=s.KEEP_CHECKPOINTS or None,
        disable_tqdm=True,  # ProgressLineCallback prints one line per step instead
        log_completions=False,  # the bound reward function writes the full completion log
        **(evaluation.grpo_config_kwargs(s, layout, cuda, first_run) if evaluate else {"eval_strategy": "no"}),
        **vllm,
    )


def build_trainer(s, model, tokenizer, train_dataset, layout: dict, completion_log=None, callbacks=(),
                  resume_step: int | None = None, measure_gap: bool = True, eval_dataset=None):
    """The recipe's trainer (training/trainer.py's GptOssGRPOTrainer) for settings `s`: the bound reward, LoRA, the
    stream, the held-out rows (evaluation.py; None = no evaluation), the run folder's callbacks, and the trainer's
    own sampler, fast paths and fixes. `model`: a loaded gpt-oss, not yet LoRA-wrapped (loading stays outside, so a
    benchmark can pass any gpt-oss-shaped model)."""
    from transformers.trainer_callback import PrinterCallback

    from data_reward import bind_reward
    from tes_grpo.model.model_loading import cuda_available
    from tes_grpo.run.callbacks import run_callbacks
    from tes_grpo.training.trainer import GptOssGRPOTrainer

    out = Path(s.OUT_DIR)
    out.mkdir(parents=True, exist_ok=True)
    trainer = GptOssGRPOTrainer(
        model=model, reward_funcs=bind_reward(s.INVALID_REWARD, completion_log), processing_class=tokenizer,
        args=build_grpo_config(s, layout, cuda_available(), eval_dataset is not None, first_run=resume_step is None),
        train_dataset=train_dataset, eval_dataset=eval_dataset,
        peft_config=build_lora_config(s.LORA_R, s.LORA_ALPHA, expert_layers(s)),
        callbacks=[*run_callbacks(out, s.BEST_METRIC if eval_dataset is not None else None, say), *callbacks],
        settings=s, generation_sequences=layout["generation_sequences"], tensorboard_dir=out / "tensorboard",
        resume_step=resume_step, measure_gap=measure_gap, say=say)
    trainer.remove_callback(PrinterCallback)  # ProgressLineCallback prints a compact line instead of the raw dict
    return trainer


def describe_run(s, layout: dict, trainer, completion_log) -> None:
    processes, passes, micro = process_count(), layout["gradient_accumulation_steps"], layout["train_batch_size"]
    steps = layout["generation_steps"]
    generated = (f"generated in {passes // layout['steps_per_generation']} batch(es)" if steps == 1 else
                 f"generated {steps} steps at a time ({layout['generation_batch']} a batch)")
    say(f"batch: {layout['completions_per_step']} completions per optimizer step = {layout['prompts_per_step']} "
        f"prompts x {s.NUM_GENERATIONS} generations, {generated}; "
        f"{micro} per forward/backward x {passes} (TRAIN_BATCH_SIZE={s.TRAIN_BATCH_SIZE}: worst case "
        f"{layout['worst_case_tokens_per_pass']} tokens a pass)"
        + (f"; per process: the {processes} processes train {processes * layout['completions_per_step']} completions "
           f"of {processes * layout['prompts_per_step']} distinct prompts per optimizer step" if processes > 1 else ""))
    if steps > 1:  # TRL computes old_per_token_logps whenever a generation batch outlasts an optimizer step
        say(f"generation: GENERATION_STEPS={steps}: one batch of {layout['generation_batch']} completions feeds "
            f"{steps} optimizer steps, shuffled across them; the later steps train on completions sampled before "
            "their latest update(s), which GRPO's clipped ratio to the log-probabilities of one extra forward pass "
            "over the batch (at generation) corrects; the completion log's step is the batch's first step")
    say(f"reward: invalid or truncated completions score INVALID_REWARD={s.INVALID_REWARD}"
        + (" (left out of the group statistics: no gradient)" if math.isnan(s.INVALID_REWARD) else ""))
    say(f"completion log: {completion_log.path}" if completion_log else "completion log: off (GRPO_LOG_COMPLETIONS)")
    trainable = sum(p.numel() for p in trainer.model.parameters() if p.requires_grad)
    say(f"LoRA r={s.LORA_R} alpha={s.LORA_ALPHA} on all-linear"
        + (f" + experts of layers {expert_layers(s)}" if s.LORA_EXPERT_LAYERS else "")
        + f": {trainable:,} trainable parameters")


# ---------------------------------------------------------------------------------------------------------------
# main: settings, run folder, data, model, trainer, train, save
# ---------------------------------------------------------------------------------------------------------------

def preflight(s, environ=None) -> dict:
    """What train() checks from the settings and files alone, before torch and transformers are imported (a second
    or two): the settings that need no library, the run folder and what RESUME asks of it, the training files, where
    the model and the tokenizer come from. Returns what train() goes on with; "finished": the checkpoint resumed is
    at TOTAL_STEPS already, nothing to train (said)."""
    from tes_grpo.run.run_folder import prepare_resume
    from tes_grpo.run.sources import check_model_id
    from tes_grpo.task.harmony import check_tokenizer_source

    check_plain_settings(s, CHOICES)
    env = read_environment(os.environ if environ is None else environ)
    out = Path(s.OUT_DIR)
    log_path = Path(env["completion_log_path"]) if env["completion_log_path"] else out / "completions.csv"
    checkpoint, step = prepare_resume(out, s.RESUME, log_path, process_count(), say, trim=False)
    start = {"env": env, "log_path": log_path, "checkpoint": checkpoint, "step": step, "finished": False}
    if checkpoint is not None and step >= s.TOTAL_STEPS:  # the trainer would run one step past max_steps
        say(f"nothing to train: {checkpoint} is at step {step} of TOTAL_STEPS={s.TOTAL_STEPS}, and its adapter is "
            "there (raise TOTAL_STEPS to train on; a new run needs another --OUT_DIR); the run folder is left as it is")
        return {**start, "finished": True}
    if checkpoint is not None and step % s.GENERATION_STEPS:  # only a checkpoint of other settings: SAVE_STEPS
        say(f"note: {checkpoint} (step {step}) is inside a generation batch of GENERATION_STEPS={s.GENERATION_STEPS} "
            "steps: TRL generates at the resumed run's first step, from that batch's prompts again, so its batches "
            f"fall {step % s.GENERATION_STEPS} step(s) off those of the uninterrupted run")
    frame = read_training_data(s)
    check_model_id(s.MODEL_ID, say=say)
    check_tokenizer_source(say=say)  # the reward decodes with it: a missing one stops here, not at the first step
    return {**start, "frame": frame}


def train(s, environ=None, callbacks=(), start: dict | None = None) -> Path:
    """Runs GRPO for resolved settings; returns OUT_DIR. callbacks: extra TrainerCallbacks (tests look inside);
    start: preflight's answer when main() has asked it already."""
    start = preflight(s, environ) if start is None else start
    out, env, checkpoint, step = Path(s.OUT_DIR), start["env"], start["checkpoint"], start["step"]
    if start["finished"]:
        return out
    from transformers import AutoConfig

    from data_reward import EVAL_RECORD_COLUMNS, CompletionLog
    from tes_grpo.model.model_loading import (
        check_machine,
        cuda_available,
        load_tokenizer_for,
        load_training_model,
        resolve_experts,
        resolve_model_path,
    )
    from tes_grpo.run.evaluation import describe as describe_evaluation
    from tes_grpo.run.evaluation import eval_dataset
    from tes_grpo.run.processes import start_process_group
    from tes_grpo.run.run_folder import drop_log_rows_after, run_summary
    from tes_grpo.task.harmony import load_tokenizer
    from tes_grpo.training.batch_layout import batch_layout, check_generation_cadence
    from tes_grpo.training.memory_plan import plan_run

    check_library_settings(s)
    check_generation_cadence(s, env["steps_per_generation"])
    if checkpoint is not None and is_main_process():  # the steps after the checkpoint are redone: their rows go
        drop_log_rows_after(out, step, start["log_path"], say)
    check_machine(s.USE_VLLM, say)
    start_process_group()
    for name, (default, value) in s.preset.items():
        say(f"MODEL_ID={s.MODEL_ID}: preset {name}={value} (default {default})")

    # Data (the model's tokenizer and config first: a MODEL_ID that cannot be loaded stops here)
    model_path = resolve_model_path(s.MODEL_ID)
    try:
        tokenizer = load_tokenizer_for(model_path, say=say)
        config = AutoConfig.from_pretrained(model_path)
    except OSError as err:  # a broken checkpoint folder, a download cut short: transformers says which
        raise SettingsError(f"MODEL_ID={s.MODEL_ID}: cannot load it: {' '.join(str(err).split())}") from None
    load_tokenizer()  # the reward's (harmony's): loaded and checked now, not at the first step's scoring
    frame = load_training_data(s, tokenizer, start["frame"])
    eval_frame = load_eval_data(s, tokenizer)
    longest = int(max(frame["prompt_tokens"].max(), 0 if eval_frame is None else eval_frame["prompt_tokens"].max()))
    if str(s.TRAIN_BATCH_SIZE) != "auto":  # auto's size comes from the memory plan, after loading
        batch_layout(s, longest, env["steps_per_generation"])  # a fixed size that cannot split the step stops here
    dataset = build_stream(frame, s).to_iterable_dataset()

    # Model, the memory it leaves (checked before loading too: a run that cannot fit stops before it), trainer
    resident = resolve_experts(s.EXPERTS, model_path, expert_layers(s), config)[0] == "mxfp4"
    bf16_layers = len(set(expert_layers(s))) if resident else 0  # EXPERTS=mxfp4 keeps LoRA's expert layers bf16
    plan_run(s, config, longest, env["steps_per_generation"], resident, loaded=False, bf16_expert_layers=bf16_layers)
    model = load_training_model(model_path, s.ATTN_IMPLEMENTATION, say=say, experts=s.EXPERTS,
                                expert_lora_layers=expert_layers(s), config=config)
    plan = plan_run(s, config, longest, env["steps_per_generation"], resident, loaded=True, say=say,
                    bf16_expert_layers=bf16_layers)
    layout = batch_layout(s, longest, env["steps_per_generation"], plan)
    slot = s.PROMPTS_PER_STEP * s.NUM_GENERATIONS  # completions of one gradient-accumulation slot
    completion_log = CompletionLog(start["log_path"], slot) if env["log_completions"] else None
    held_out = None if eval_frame is None else eval_dataset(eval_frame, EVAL_RECORD_COLUMNS)
    trainer = build_trainer(s, model, tokenizer, dataset, layout, completion_log, callbacks,
                            resume_step=step if checkpoint else None, eval_dataset=held_out)
    describe_run(s, layout, trainer, completion_log)
    eval_prompts = 0 if held_out is None else len(held_out)
    say(describe_evaluation(s, eval_prompts, layout, cuda_available(), first_run=checkpoint is None))
    if is_main_process():
        extra = {"attn_implementation": model.config._attn_implementation, "dtype": str(model.dtype),
                 "train_prompts": len(frame), "completion_log": str(start["log_path"]) if completion_log else "",
                 "eval_prompts": eval_prompts}
        save_config(run_summary(s, layout, extra, process_count()), out / "train_config.json")

    # Train and save
    if checkpoint is not None:
        say(f"resuming from {checkpoint} at step {step} of {s.TOTAL_STEPS}")
    trainer.train(resume_from_checkpoint=str(checkpoint) if checkpoint else None)
    trainer.save_model(str(out))  # adapter + tokenizer (every process takes part under FSDP; rank 0 writes)
    trainer.save_state()
    say(f"done: adapter, tokenizer and trainer state in {out}")
    return out


def main(argv: list[str] | None = None, callbacks=()) -> int:
    """Command-line entry: resolves --NAME=value overrides (and the tiny preset), trains; returns the exit status:
    0 done, 1 an error said in one line, 130 stopped by Ctrl-C (saying where, and how the run goes on)."""
    settings = resolve(globals(), argv, presets=PRESETS, allow_nan={"INVALID_REWARD"}, choices=CHOICES)
    watch = None
    try:
        start = preflight(settings)  # no torch yet: a bad folder, data file or model stops within a second or two
        if start["finished"]:
            return 0
        with interrupts_held():  # a Ctrl-C inside torch's C++ start-up would abort the process
            import torch

        from tes_grpo.run.oom import StepWatch, out_of_memory_message, use_expandable_segments
        from tes_grpo.training.memory_plan import no_plan_reason

        use_expandable_segments(say, torch.cuda.is_available(), torch.cuda.is_initialized(), vllm=settings.USE_VLLM)
        watch = StepWatch()
        try:
            train(settings, callbacks=(*callbacks, watch), start=start)
        except torch.OutOfMemoryError as err:  # one message, no traceback; the newest checkpoint stays resumable
            planned = no_plan_reason(settings) is None
            print(out_of_memory_message(settings, watch.step, err, planned, watch.ended), file=sys.stderr)
            _leave_process_group(wait=False)
            return 1
    except (InputError, SettingsError) as err:
        print(f"error: {err}", file=sys.stderr)
        _leave_process_group(wait=False)
        return 1
    except KeyboardInterrupt:
        from tes_grpo.run.run_folder import stopped_message

        if is_main_process():
            step, ended = (watch.step, watch.ended) if watch is not None else (None, False)
            print(stopped_message(Path(settings.OUT_DIR), settings.TOTAL_STEPS, step, ended, "stopped by Ctrl-C"),
                  file=sys.stderr)
        _leave_process_group(wait=False)
        return 130
    _leave_process_group(wait=True)
    return 0


def _leave_process_group(wait: bool) -> None:
    # asked of torch only where train() may have started a group: importing torch to ask would take seconds, and
    # after a Ctrl-C inside `import torch` it may be half imported
    dist = sys.modules.get("torch.distributed")
    if dist is not None and getattr(dist, "is_initialized", lambda: False)():
        from tes_grpo.patches.torch_patches import leave_process_group

        leave_process_group(wait=wait)


if __name__ == "__main__":
    sys.exit(main())
