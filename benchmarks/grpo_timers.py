"""Timers for benchmarks/bench_grpo.py: generation time inside GRPO and per-step rows (imported by its main(), so
its --help does not load torch)."""

from __future__ import annotations

import json
import time
from pathlib import Path

import torch
from transformers import TrainerCallback

from benchmarks.decode_limit import DecodeLimit
from benchmarks.mfu import mfu_fields
from tes_grpo.run.processes import gather_on_main, process_count, uses_fsdp


def attention_gflop_per_row(length: int, config) -> float:
    """GFLOP of attention's two matmuls (scores q.k and the weighted sum of v) for one row of `length` real tokens
    in training: a forward, the backward to q, k and v (twice a forward) and checkpointing's recomputed forward.

    The parameter count (TRAIN_GFLOP_PER_TOKEN) leaves these out, and they grow with the square of the length:
    9-10 % on top of it at 4,000-token completions. Counted as computed: each token attends to itself and the
    tokens before it, and on sliding-window layers to at most `sliding_window` of them (as PaLM's and nanoGPT's
    MFU count attention, less the masked half they include).
    """
    keys = 0
    for kind in config.layer_types:
        window = config.sliding_window if kind == "sliding_attention" else length
        window = min(window, length)
        keys += window * (window + 1) // 2 + (length - window) * window  # sum over positions p of min(p + 1, window)
    forward = 2 * 2 * config.num_attention_heads * config.head_dim * keys  # two matmuls, a multiply-add each
    return 4 * forward / 1e9


class GenerationTimer:
    """Stands in for the trainer's sampler (sampling/sampler.py's Sampler, whose `generate` it calls) to add up its
    wall time, the completion tokens it produced, and each call's (sequences, mean real prompt tokens, new tokens)
    for the decode limit."""

    def __init__(self, sampler):
        self.sampler = sampler
        self.seconds = 0.0
        self.tokens = 0
        self.sequences = 0
        self.calls: list[tuple[int, float, int]] = []

    def generate(self, model, input_ids, attention_mask, generation_config):
        torch.cuda.synchronize()
        start = time.perf_counter()
        out, logprobs = self.sampler.generate(model, input_ids, attention_mask, generation_config)
        torch.cuda.synchronize()
        self.seconds += time.perf_counter() - start
        prompt = float(attention_mask.sum(dim=1).float().mean()) if attention_mask is not None else float(
            input_ids.shape[1])
        new = out.shape[1] - input_ids.shape[1]
        self.tokens += new * out.shape[0]
        self.sequences += out.shape[0]
        self.calls.append((out.shape[0], prompt, new))
        return out, logprobs


def generation_cycles(rows: list[dict]) -> list[dict]:
    """The steps grouped by the generation batch they train on: each group starts at a step that generated (a row's
    "generated") and takes the reuse steps after it. With train_grpo's GENERATION_STEPS=k only the first of k steps
    generates, so one step's time says little; a group's mean step time is the figure to set beside
    GENERATION_STEPS=1. Returns per group: first and last step, steps, mean step seconds."""
    groups: list[list[dict]] = []
    for row in rows:
        if row["generated"] or not groups:
            groups.append([])
        groups[-1].append(row)
    return [{"first": g[0]["step"], "last": g[-1]["step"], "steps": len(g),
             "mean_step_s": sum(r["step_s"] for r in g) / len(g)} for g in groups]


class StepTimer(TrainerCallback):
    """Per optimizer step: wall time, the generation share of it, tokens/s, peak memory, ratios to the limits (the
    decode limit of the step's generate calls, decode_limit.py; MFU against the spec peak and the measured matrix
    rate, mfu.py), and
    the step's sampling metrics (sampler against trainer, from `fidelity`: the trainer's GapMeter,
    which logs them in the step's last micro-batch, before this callback's on_step_end). A step that trains on an
    earlier step's generation batch (GENERATION_STEPS > 1) has generated False and generation 0 s; the step that
    generated counts in its training seconds TRL's no-grad forward over the whole batch (the old log-probabilities
    the later steps' clipped ratio needs). Every step is counted as training the step's completions (layout), at the
    latest batch's mean completion length."""

    def __init__(self, timer: GenerationTimer | None, limit: DecodeLimit, prompt_tokens: int, results: Path, bench,
                 layout: dict, model_config):
        self.timer, self.limit, self.prompt_tokens, self.results = timer, limit, prompt_tokens, results
        self.bench, self.layout, self.model_config = bench, layout, model_config
        self.fidelity = None
        self.spec_tflops: float | None = None  # the GPU's spec dense bf16 peak, MFU's denominator (mfu.spec_peak)
        self.rows: list[dict] = []
        self.batch_tokens_per_row = 0.0  # mean completion tokens of the latest generation batch

    def on_step_begin(self, args, state, control, **kwargs):
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        self.start = time.perf_counter()
        self.before = (self.timer.seconds, self.timer.tokens, self.timer.sequences)
        self.first_call = len(self.timer.calls)

    def on_step_end(self, args, state, control, **kwargs):
        torch.cuda.synchronize()
        total = time.perf_counter() - self.start
        gen, tokens, seqs = (now - then for now, then in
                             zip((self.timer.seconds, self.timer.tokens, self.timer.sequences), self.before,
                                 strict=True))
        # every process's generation time and peak memory, on rank 0 (a collective: every rank gets here each step)
        per_gpu = gather_on_main([(gen, torch.cuda.max_memory_allocated() / 2**30,
                                   torch.cuda.max_memory_reserved() / 2**30)])
        if per_gpu is None:
            return
        train_s = total - gen
        # the decode limit of this step's generate calls (decode_limit.py): what their decode steps must read, at
        # the copy rate measured on this GPU
        calls = self.timer.calls[self.first_call:]
        limit_s = self.limit.calls_seconds(calls)
        contexts = [prompt + new / 2 for _, prompt, new in calls]
        if seqs:  # this step generated: the steps up to the next generation train on this batch
            self.batch_tokens_per_row = tokens / seqs
        trained = self.layout["completions_per_step"]  # per process
        row_tokens = self.prompt_tokens + self.batch_tokens_per_row
        trained_tokens = trained * row_tokens
        train_gflop = trained_tokens * self.bench.TRAIN_GFLOP_PER_TOKEN
        # at the mean row length: the square's convexity makes this a slight undercount when lengths vary
        attention_gflop = trained * attention_gflop_per_row(round(row_tokens), self.model_config)
        row = dict(step=state.global_step, generated=bool(calls), generation_steps=self.layout["generation_steps"],
                   step_s=total, generation_s=gen, training_s=train_s, sequences=seqs,
                   completion_tokens=tokens, gen_tokens_per_s=tokens / gen if gen else 0.0, gen_share=gen / total,
                   decode_limit_s=limit_s, decode_limit_share=limit_s / gen if gen else 0.0,
                   decode_mean_cache=sum(contexts) / len(contexts) if contexts else 0.0,
                   decode_bytes_gb=(self.limit.bytes(calls[0][0], contexts[0]).total / 1e9) if calls else 0.0,
                   copy_rate_tb_per_s=self.limit.rate / 1e12,
                   **mfu_fields(train_gflop, attention_gflop, train_s, self.spec_tflops, self.bench.BF16_TFLOPS),
                   decode_experts=self.bench.DECODE_EXPERTS, decode_graphs=str(self.bench.DECODE_GRAPHS),
                   train_experts=self.bench.TRAIN_EXPERTS, model_size=self.bench.MODEL_SIZE,
                   experts=self.bench.EXPERTS,
                   max_completion_len=self.bench.MAX_COMPLETION_LEN, prompt_tokens=self.prompt_tokens,
                   train_batch_size=self.layout["train_batch_size"],
                   passes=self.layout["gradient_accumulation_steps"])
        processes = process_count()
        row.update(processes=processes, sharding="fsdp2" if uses_fsdp() else "ddp" if processes > 1 else "none",
                   generation_s_per_gpu=[g for g, _, _ in per_gpu], peak_gib_per_gpu=[m for _, m, _ in per_gpu],
                   peak_gib=max(m for _, m, _ in per_gpu), reserved_gib=max(r for _, _, r in per_gpu),
                   completions_per_step=trained * processes,
                   completions_per_s=trained * processes / total)
        row.update(self.fidelity.latest if self.fidelity is not None else {})
        self.rows.append(row)
        with self.results.open("a") as f:
            f.write(json.dumps(row) + "\n")
        print(f"[bench] step {row['step']}: {total:.1f} s (generation {gen:.1f} s"
              + ("" if calls else ": trains an earlier step's generation batch") + f", training {train_s:.1f} s), "
              f"{row['gen_tokens_per_s']:.0f} tok/s per GPU, {row['completions_per_s']:.2f} completions/s, peak "
              + " / ".join(f"{m:.1f}" for m in row["peak_gib_per_gpu"]) + " GiB", flush=True)
