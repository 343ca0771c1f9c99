"""Builds the embedded tiny gpt-oss: a 2-layer `GptOssForCausalLM` in the real MXFP4 checkpoint layout.

    .venv/bin/python -m tes_grpo.model.tiny_model             # build runs/tiny-gpt-oss/ (once; ~1.5 min on 2 CPU cores)
    .venv/bin/python -m tes_grpo.model.tiny_model --REBUILD   # build it again

`train_grpo.py --MODEL_ID=tiny` calls `ensure_tiny_checkpoint()`, so you rarely run this yourself.

What it is: gpt-oss's architecture at toy size (hidden 64, 2 layers: one sliding-window and one full attention
layer with attention sinks, 2 query heads sharing 1 key/value head, 4 experts of which 2 are active per token)
with the real 201,088-token vocabulary and the real tokenizer and chat template (from `../shared/gpt-oss-tokenizer`,
see harmony.py), random weights from a fixed seed. It is written by `mxfp4_checkpoint.write_mxfp4_checkpoint` exactly
like openai/gpt-oss-20b: expert weights as `*_blocks` / `*_scales` (MXFP4), everything else bf16, `quantization_config`
mxfp4, the original checkpoint's config keys (`rope_theta`, `rope_scaling`, `experts_per_token`, ...), plus the
tokenizer files (the chat template also inside tokenizer_config.json, where Ollama reads it) and gpt-oss-20b's
generation_config.json (stop tokens <|return|>, <|endoftext|>, <|call|>). Training loads it through
`Mxfp4Config(dequantize=True)`, the same path as the 20B.

The warm-up (why and what): a random model never writes a Harmony answer, so every reward would be NaN and GRPO
would have nothing to learn from. Before writing, a short supervised warm-up (WARMUP_STEPS AdamW steps, ~1.5 min
on 2 CPU cores, on task prompts built by task_prompt.build_prompt from random series and rendered like the datasets
by harmony.render_harmony_prompt; no dataset is read) teaches the answer FORMAT only:

    <|channel|>analysis<|message|>Compare load and CO2 for the hours left.<|end|><|start|>assistant
    <|channel|>final<|message|>[k]<|return|>        (one line in the model's text)

with k drawn uniformly at random for every example, independent of the prompt. So after the warm-up the model
answers in the right format with each action about equally likely, and any later rise in reward comes from GRPO
learning which actions are better. The expert weights are rounded to the MXFP4 grid first and frozen during
the warm-up, so the written checkpoint holds exactly the experts the warm-up used.
"""

from __future__ import annotations

import json
import math
import os
import shutil
import sys
import time
from datetime import datetime, timedelta
from pathlib import Path

import torch
from filelock import FileLock, Timeout
from tqdm import tqdm
from transformers import GenerationConfig, GptOssConfig, GptOssForCausalLM

from tes_grpo.experts.mxfp4 import fake_quantize_expert_param
from tes_grpo.experts.mxfp4_checkpoint import save_tokenizer_files, write_mxfp4_checkpoint
from tes_grpo.run.fileio import give_default_modes, temporary_folder
from tes_grpo.run.script_config import constants_of, resolve
from tes_grpo.task import (
    harmony,  # the module, not its constants: current_settings() reads this module's UPPER_CASE names
    task_prompt,
    tes_env,
)

_REPO_ROOT = Path(__file__).resolve().parents[2]

TINY_DIR = str(_REPO_ROOT / "runs" / "tiny-gpt-oss")  # where the tiny checkpoint is built and cached
SEED = 1234  # seeds the random weights, the warm-up prompts and the warm-up actions
HIDDEN_SIZE = 64  # model width; a multiple of 32 (the MXFP4 block size)
INTERMEDIATE_SIZE = 64  # expert MLP width; a multiple of 32
NUM_LAYERS = 2  # decoder layers: sliding-window attention, then full attention (gpt-oss alternates them)
NUM_HEADS = 2  # query heads (each with its own learned attention sink)
NUM_KV_HEADS = 1  # key/value heads (grouped-query attention, as in gpt-oss)
HEAD_DIM = 16  # per-head width
NUM_EXPERTS = 4  # experts per MoE layer
EXPERTS_PER_TOKEN = 2  # experts active per token
WARMUP_STEPS = 80  # format warm-up optimizer steps (0 = none: the model then never answers validly)
WARMUP_BATCH = 8  # prompts per warm-up step
WARMUP_LR = 1e-2  # warm-up AdamW learning rate
REBUILD = False  # build again even if TINY_DIR already holds a finished checkpoint

_WARMUP_ANALYSIS = "Compare load and CO2 for the hours left."
_BUILD_VERSION = 3  # bump when the builder changes, so cached checkpoints from older builders are rebuilt
_BUILD_INFO = "tiny_model.json"  # written last: its presence marks a finished checkpoint


def current_settings() -> dict:
    """This module's constants: the build's default settings (main() passes its resolved ones down instead)."""
    return constants_of(globals())


def tiny_config(vocab_size: int = 201088, settings: dict | None = None):
    """gpt-oss-20b's config at toy size: same vocabulary, special token ids, RoPE (yarn) and layer pattern."""
    s = settings or current_settings()
    if s["HIDDEN_SIZE"] % 32 or s["INTERMEDIATE_SIZE"] % 32:
        raise ValueError("HIDDEN_SIZE and INTERMEDIATE_SIZE must be multiples of 32 (the MXFP4 block size)")
    return GptOssConfig(
        vocab_size=vocab_size, hidden_size=s["HIDDEN_SIZE"], intermediate_size=s["INTERMEDIATE_SIZE"],
        num_hidden_layers=s["NUM_LAYERS"], num_attention_heads=s["NUM_HEADS"], num_key_value_heads=s["NUM_KV_HEADS"],
        head_dim=s["HEAD_DIM"], num_local_experts=s["NUM_EXPERTS"], num_experts_per_tok=s["EXPERTS_PER_TOKEN"],
        sliding_window=128,
        layer_types=["sliding_attention" if i % 2 == 0 else "full_attention" for i in range(s["NUM_LAYERS"])],
        max_position_embeddings=131072, rms_norm_eps=1e-5, swiglu_limit=7.0, attention_bias=True,
        tie_word_embeddings=False, pad_token_id=harmony.PAD_ID, eos_token_id=harmony.RETURN_ID,
        bos_token_id=harmony.BOS_ID, use_cache=True,
    )


def build_tiny_model(config, seed: int):
    """Random-weight GptOssForCausalLM in float32, experts already on the MXFP4 grid (so writing them is exact)."""
    torch.manual_seed(seed)
    model = GptOssForCausalLM(config).to(torch.float32)
    with torch.no_grad():
        for layer in model.model.layers:
            experts = layer.mlp.experts
            # Nonzero biases so the checkpoint's bias tensors are exercised, not just zeros.
            experts.gate_up_proj_bias.normal_(0.0, config.initializer_range)
            experts.down_proj_bias.normal_(0.0, config.initializer_range)
            for name in ("gate_up_proj", "down_proj"):
                param = getattr(experts, name)
                param.copy_(fake_quantize_expert_param(param.data).to(torch.float32))
    return model


# ---------------------------------------------------------------------------------------------------------------
# Format warm-up
# ---------------------------------------------------------------------------------------------------------------

def random_series(rng: torch.Generator):
    """A random 4-day TES input series (tes_env.Series): smooth CO2 factors, load in business hours only."""
    start = datetime(2024, 6, 1) + timedelta(days=int(torch.randint(0, 90, (1,), generator=rng)))
    hours = tes_env.SERIES_HOURS
    phase = float(torch.rand(1, generator=rng)) * 6.28
    co2 = [round(0.38 + 0.08 * math.sin(phase + h / 3.8) + 0.03 * float(torch.rand(1, generator=rng)), 3)
           for h in range(hours)]
    peak = 20 + 60 * float(torch.rand(1, generator=rng))
    load = [round(peak * (0.4 + 0.6 * float(torch.rand(1, generator=rng))), 1)
            if tes_env.FIRST_BUSINESS_HOUR <= h % 24 <= tes_env.LAST_BUSINESS_HOUR else 0.0 for h in range(hours)]
    return tes_env.Series(name="warm-up", datetimes=tuple(start + timedelta(hours=h) for h in range(hours)),
                          co2=tuple(co2), load=tuple(load))


def warmup_prompt(tokenizer, rng: torch.Generator) -> str:
    """A task prompt (task_prompt.build_prompt, rendered like the datasets by harmony.render_harmony_prompt) on a
    random series.

    Same instructions, table layout and length (~850 tokens) as the training prompts, with random numbers and a
    random reasoning effort, so the format the warm-up teaches carries over to the real prompts.
    """
    series = random_series(rng)
    decisions = [t for t in range(tes_env.EPISODE_HOURS) if tes_env.is_business_hour(t)]
    t = decisions[int(torch.randint(0, len(decisions), (1,), generator=rng))]
    energy = round(float(torch.rand(1, generator=rng)) * tes_env.CAPACITY_KWH, 1)
    system, user = task_prompt.build_prompt(series, t, energy)
    effort = harmony.REASONING_EFFORTS[int(torch.randint(0, len(harmony.REASONING_EFFORTS), (1,), generator=rng))]
    return harmony.render_harmony_prompt(system, user, tokenizer, effort)


def warmup_completion(action: int) -> str:
    return (f"<|channel|>analysis<|message|>{_WARMUP_ANALYSIS}<|end|><|start|>assistant"
            f"<|channel|>final<|message|>[{action}]<|return|>")


def warmup_batch(tokenizer, rng: torch.Generator, batch_size: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(input_ids, attention_mask, loss_mask) for one warm-up batch, right-padded; loss only on completions."""
    sequences, masks = [], []
    for _ in range(batch_size):
        prompt = warmup_prompt(tokenizer, rng)
        action = int(torch.randint(0, 4, (1,), generator=rng))
        prompt_ids = tokenizer(prompt, add_special_tokens=False)["input_ids"]
        completion_ids = tokenizer(warmup_completion(action), add_special_tokens=False)["input_ids"]
        sequences.append(prompt_ids + completion_ids)
        masks.append([0] * len(prompt_ids) + [1] * len(completion_ids))
    width = max(len(s) for s in sequences)
    pad = tokenizer.pad_token_id
    input_ids = torch.tensor([s + [pad] * (width - len(s)) for s in sequences])
    attention = torch.tensor([[1] * len(s) + [0] * (width - len(s)) for s in sequences])
    loss_mask = torch.tensor([m + [0] * (width - len(m)) for m in masks])
    return input_ids, attention, loss_mask


def completion_loss(model, input_ids: torch.Tensor, attention: torch.Tensor, loss_mask: torch.Tensor) -> torch.Tensor:
    """Next-token cross-entropy on completion tokens only; the 201k-wide logits are made only where needed."""
    hidden = model.model(input_ids=input_ids, attention_mask=attention).last_hidden_state
    targets = loss_mask[:, 1:].bool()
    logits = model.lm_head(hidden[:, :-1][targets])
    return torch.nn.functional.cross_entropy(logits.float(), input_ids[:, 1:][targets])


def warm_up_format(model, tokenizer, steps: int, batch_size: int, lr: float, seed: int) -> list[float]:
    """Teaches the Harmony answer format with uniformly random actions (see module docstring); returns losses.

    Expert matrices stay frozen (they are already on the MXFP4 grid); everything else trains.
    """
    rng = torch.Generator().manual_seed(seed + 1)
    frozen = ("experts.gate_up_proj", "experts.down_proj")
    trainable = [p for n, p in model.named_parameters() if not n.endswith(frozen)]
    for name, param in model.named_parameters():
        param.requires_grad_(not name.endswith(frozen))
    optimizer = torch.optim.AdamW(trainable, lr=lr, weight_decay=0.0)
    model.train()
    losses = []
    for _ in tqdm(range(steps), desc="format warm-up", unit="step"):
        loss = completion_loss(model, *warmup_batch(tokenizer, rng, batch_size))
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        losses.append(loss.item())
    model.eval()
    for param in model.parameters():
        param.requires_grad_(True)
    return losses


# ---------------------------------------------------------------------------------------------------------------
# Writing and caching
# ---------------------------------------------------------------------------------------------------------------

def write_tiny_checkpoint(model, tokenizer, out_dir: str | os.PathLike, info: dict) -> Path:
    """MXFP4 checkpoint (mxfp4_checkpoint.write_mxfp4_checkpoint) + tokenizer + generation config + build info, in
    out_dir."""
    out_dir = Path(out_dir)
    model.config.architectures = ["GptOssForCausalLM"]  # as in openai/gpt-oss-20b's config.json
    stats = write_mxfp4_checkpoint(model, model.config, out_dir)
    save_tokenizer_files(tokenizer, out_dir)
    # openai/gpt-oss-20b's generation_config.json: generation stops at any of the stop tokens
    GenerationConfig(bos_token_id=harmony.BOS_ID, do_sample=True,
                     eos_token_id=[harmony.RETURN_ID, harmony.PAD_ID, harmony.CALL_ID],
                     pad_token_id=harmony.PAD_ID).save_pretrained(out_dir)
    info = {**info, "checkpoint": {k: v for k, v in stats.items() if k != "files"}}
    (out_dir / _BUILD_INFO).write_text(json.dumps(info, indent=2) + "\n", encoding="utf-8")
    return out_dir


def build_settings(settings: dict) -> dict:
    """The settings that shape the checkpoint (not where it goes or whether to rebuild)."""
    return {k: v for k, v in settings.items() if k not in ("TINY_DIR", "REBUILD")}


def is_finished_checkpoint(path: str | os.PathLike) -> bool:
    return (Path(path) / _BUILD_INFO).is_file()


def stale_reason(path: str | os.PathLike, settings: dict | None = None) -> str | None:
    """Why the finished checkpoint at path differs from what this builder would make now, or None."""
    info = json.loads((Path(path) / _BUILD_INFO).read_text(encoding="utf-8"))
    if info.get("version") != _BUILD_VERSION:
        return f"built by builder version {info.get('version')}, this is version {_BUILD_VERSION}"
    wanted = build_settings(settings or current_settings())
    changed = sorted(k for k in wanted if info.get("settings", {}).get(k) != wanted[k])
    return f"settings changed: {', '.join(changed)}" if changed else None


def build_tiny_checkpoint(out_dir: str | os.PathLike, settings: dict | None = None) -> Path:
    """Builds, warms up and writes the tiny model into out_dir (via a temporary folder renamed at the end)."""
    s = settings or current_settings()
    out_dir = Path(out_dir)
    tokenizer = harmony.load_tokenizer()
    started = time.time()
    config = tiny_config(vocab_size=len(tokenizer), settings=s)
    model = build_tiny_model(config, s["SEED"])
    n_params = sum(p.numel() for p in model.parameters())
    print(f"tiny gpt-oss: {n_params / 1e6:.1f} M parameters (hidden {config.hidden_size}, {config.num_hidden_layers} "
          f"layers, {config.num_local_experts} experts), tokenizer from {harmony.tokenizer_source()}")
    losses = []
    if s["WARMUP_STEPS"] > 0:
        losses = warm_up_format(model, tokenizer, s["WARMUP_STEPS"], s["WARMUP_BATCH"], s["WARMUP_LR"], s["SEED"])
        print(f"format warm-up: loss {losses[0]:.3f} -> {losses[-1]:.3f} over {len(losses)} steps")
    else:
        print("format warm-up skipped (WARMUP_STEPS=0): the model will not answer in the Harmony format")
    info = {"version": _BUILD_VERSION, "settings": build_settings(s),
            "warmup_loss_first": losses[0] if losses else None, "warmup_loss_last": losses[-1] if losses else None,
            "parameters": n_params, "tokenizer_source": harmony.tokenizer_source(),
            "build_seconds": round(time.time() - started, 1)}
    tmp = temporary_folder(out_dir)
    try:
        write_tiny_checkpoint(model, tokenizer, tmp, info)
        give_default_modes(tmp)
        if out_dir.exists():
            shutil.rmtree(out_dir)
        os.replace(tmp, out_dir)
    finally:
        if tmp.exists():
            shutil.rmtree(tmp)
    print(f"wrote the tiny MXFP4 checkpoint to {out_dir} in {time.time() - started:.0f} s")
    return out_dir


def ensure_tiny_checkpoint(out_dir: str | os.PathLike | None = None, rebuild: bool = False,
                           settings: dict | None = None) -> Path:
    """The tiny checkpoint folder (default TINY_DIR), built first when it is missing, stale or rebuild=True.

    settings: the build settings (default: this module's constants).
    """
    settings = settings or current_settings()
    out_dir = Path(out_dir or settings["TINY_DIR"])
    out_dir.parent.mkdir(parents=True, exist_ok=True)
    # Two processes building at once (two test runs, two launches) would each replace the folder, one of them
    # while the other's processes load from it: the second waits and then finds the first's checkpoint.
    lock = FileLock(f"{out_dir}.lock")
    try:
        lock.acquire(timeout=0)
    except Timeout:
        print(f"waiting for another process building the tiny gpt-oss at {out_dir}", flush=True)
        lock.acquire()
    try:
        if is_finished_checkpoint(out_dir) and not rebuild:
            reason = stale_reason(out_dir, settings)
            if reason is None:
                print(f"using the cached tiny gpt-oss at {out_dir} (python -m tes_grpo.model.tiny_model --REBUILD "
                      f"builds it again)")
                return out_dir
            print(f"rebuilding the tiny gpt-oss at {out_dir}: {reason}")
        return build_tiny_checkpoint(out_dir, settings)
    finally:
        lock.release()


def main(argv: list[str] | None = None) -> int:
    settings = resolve(globals(), argv)
    try:
        ensure_tiny_checkpoint(settings.TINY_DIR, rebuild=settings.REBUILD, settings=settings)
    except ValueError as err:  # no tokenizer to build it with (harmony's SourceError), or settings that cannot work
        print(f"error: {err}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
