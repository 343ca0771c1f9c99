"""Real GRPO steps on a gpt-oss-20b-shaped model (random weights) through train_grpo.py's own wiring, timed.

Run on the GPU machine (the tokenizer folder must be reachable: GPT_OSS_TOKENIZER=<folder>):

    python benchmarks/bench_grpo.py --STEPS=2 --MAX_COMPLETION_LEN=512 --DECODE_EXPERTS=auto
    python benchmarks/bench_grpo.py --STEPS=2 --MAX_COMPLETION_LEN=512 --DECODE_GRAPHS=0    # transformers' generate
    accelerate launch --config_file configs/accelerate/ddp.yaml benchmarks/bench_grpo.py --STEPS=2     # several GPUs
    accelerate launch --config_file configs/accelerate/fsdp2.yaml benchmarks/bench_grpo.py --STEPS=2   # sharded weights

It builds the 20B architecture in bf16 on the GPU (gpt_oss_shapes.py), takes the real TES prompts from data/,
and runs train_grpo.build_trainer(...).train() for STEPS optimizer steps at train_grpo's default batch settings
(64 completions a step). Random weights never emit an end token, so every completion runs to
MAX_COMPLETION_LEN: the worst case. Per step it prints generation and training time, completion tokens/s,
peak memory, and the ratios to the limits (decode: every weight read once per token step at the measured
~3.0 TB/s; training: ~22 GFLOP a token against ~800 TFLOP/s of bf16 matrix rate). Under accelerate launch every
process builds the model on its own GPU (FSDP then shards it) and runs train_grpo's per-process batch; rank 0
prints each step with the peak memory of every GPU and the completions per second of all of them together.
"""

from __future__ import annotations

import sys as _sys
from pathlib import Path as _Path

# Run as `python benchmarks/<name>.py` from the repo root: Python puts benchmarks/ on sys.path, not the root
# that holds train_grpo.py and the tes_grpo package.
_sys.path.insert(0, str(_Path(__file__).resolve().parents[1]))

import json
import time
from pathlib import Path

import torch
from transformers import TrainerCallback

import train_grpo
from tes_grpo.gpt_oss_shapes import build_random_model, stack_versions
from tes_grpo.processes import (
    gather_on_main,
    is_main_process,
    local_rank,
    process_count,
    say,
    start_process_group,
    uses_fsdp,
)
from tes_grpo.script_config import resolve

STEPS = 2  # optimizer steps to time (the first includes compilation and warm-up)
MAX_COMPLETION_LEN = 512  # tokens per completion (random weights always reach it)
DECODE_EXPERTS = "auto"  # train_grpo's DECODE_EXPERTS: auto | grouped_mm | transformers (its batched_mm switch)
DECODE_GRAPHS = "auto"  # train_grpo's DECODE_GRAPHS: auto (on, on a GPU), 1, 0 (transformers' generate)
TRAIN_BATCH_SIZE = "auto"  # train_grpo's TRAIN_BATCH_SIZE: auto (from TRAIN_TOKENS_PER_PASS) or a number
TRAIN_TOKENS_PER_PASS = 40000  # train_grpo's auto micro-batch budget (tokens per forward/backward, worst case)
PROMPT_TOKENS = 1316  # lengthen each data/ prompt to about this many tokens (issue 3's measured length); 0 = as is
OUT_DIR = "runs/bench-grpo"  # run folder (adapter, logs) on the GPU machine
RESULTS = "runs/bench-grpo/results.jsonl"  # one JSON line per timed step is appended here
HBM_TB_PER_S = 3.0  # measured device-to-device copy rate of the H100 here (KINDS.md)
BF16_TFLOPS = 800.0  # measured bf16 matrix rate of the H100 here (KINDS.md)
TRAIN_GFLOP_PER_TOKEN = 22.0  # forward + backward to activations + recomputation, 3.6 B active parameters


FILLER = " Serve the cooling load first; among the ways to serve it, prefer the one with the least CO2."


def lengthen_prompts(frame, tokenizer, target: int):
    """Pads each prompt's developer message with a repeated note until the prompt is about `target` tokens.

    The repo's TES prompts are ~850 tokens; the measurements in issues 3 and 5 used ~1,316-token prompts. Cost
    depends on length, not content (random weights), so padding makes the figures comparable.
    """
    per_filler = len(tokenizer(FILLER, add_special_tokens=False).input_ids)
    marker = "<|end|><|start|>user"

    def pad(prompt: str) -> str:
        missing = target - len(tokenizer(prompt, add_special_tokens=False).input_ids)
        if missing <= 0 or marker not in prompt:
            return prompt
        head, _, tail = prompt.partition(marker)
        return head + "\n\nNotes:" + FILLER * (missing // per_filler) + marker + tail

    frame = frame.copy()
    frame["prompt"] = frame["prompt"].map(pad)
    return frame


class GenerationTimer:
    """Wraps a model's generate() to add up its wall time and the completion tokens it produced."""

    def __init__(self, model):
        self.model, self.inner = model, model.generate
        self.seconds = 0.0
        self.tokens = 0
        self.sequences = 0
        model.generate = self

    def __call__(self, *args, **kwargs):
        torch.cuda.synchronize()
        start = time.perf_counter()
        out = self.inner(*args, **kwargs)
        torch.cuda.synchronize()
        self.seconds += time.perf_counter() - start
        prompt_len = kwargs["input_ids"].shape[1] if "input_ids" in kwargs else args[0].shape[1]
        self.tokens += (out.shape[1] - prompt_len) * out.shape[0]
        self.sequences += out.shape[0]
        return out


class StepTimer(TrainerCallback):
    """Per optimizer step: wall time, the generation share of it, tokens/s, peak memory, ratios to the limits."""

    def __init__(self, timer: GenerationTimer | None, weight_bytes: int, prompt_tokens: int, results: Path, bench,
                 layout: dict):
        self.timer, self.weight_bytes, self.prompt_tokens, self.results = timer, weight_bytes, prompt_tokens, results
        self.bench, self.layout = bench, layout
        self.rows: list[dict] = []

    def on_step_begin(self, args, state, control, **kwargs):
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        self.start = time.perf_counter()
        self.before = (self.timer.seconds, self.timer.tokens, self.timer.sequences)

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
        # tokens/s if each decoding step read every weight exactly once at the measured bandwidth
        decode_limit = seqs / (self.weight_bytes / (HBM_TB_PER_S * 1e12))
        trained_tokens = seqs * self.prompt_tokens + tokens
        row = dict(step=state.global_step, step_s=total, generation_s=gen, training_s=train_s, sequences=seqs,
                   completion_tokens=tokens, gen_tokens_per_s=tokens / gen if gen else 0.0, gen_share=gen / total,
                   decode_limit_tokens_per_s=decode_limit,
                   train_mfu=trained_tokens * TRAIN_GFLOP_PER_TOKEN * 1e9 / max(train_s, 1e-9) / (BF16_TFLOPS * 1e12),
                   decode_experts=self.bench.DECODE_EXPERTS, decode_graphs=str(self.bench.DECODE_GRAPHS),
                   max_completion_len=self.bench.MAX_COMPLETION_LEN, prompt_tokens=self.prompt_tokens,
                   train_batch_size=self.layout["train_batch_size"],
                   passes=self.layout["gradient_accumulation_steps"])
        processes = process_count()
        row.update(processes=processes, sharding="fsdp2" if uses_fsdp() else "ddp" if processes > 1 else "none",
                   generation_s_per_gpu=[g for g, _, _ in per_gpu], peak_gib_per_gpu=[m for _, m, _ in per_gpu],
                   peak_gib=max(m for _, m, _ in per_gpu), reserved_gib=max(r for _, _, r in per_gpu),
                   completions_per_step=seqs * processes,
                   completions_per_s=seqs * processes / total)
        self.rows.append(row)
        with self.results.open("a") as f:
            f.write(json.dumps(row) + "\n")
        print(f"[bench] step {row['step']}: {total:.1f} s (generation {gen:.1f} s, training {train_s:.1f} s), "
              f"{row['gen_tokens_per_s']:.0f} tok/s per GPU, {row['completions_per_s']:.2f} completions/s, peak "
              + " / ".join(f"{m:.1f}" for m in row["peak_gib_per_gpu"]) + " GiB", flush=True)


def main(argv: list[str] | None = None) -> None:
    bench = resolve(globals(), argv)
    start_process_group()
    torch.cuda.set_device(local_rank())
    say(stack_versions())
    from tes_grpo.gpt_oss_tokenizer import load_tokenizer

    settings = train_grpo.default_settings(
        OUT_DIR=bench.OUT_DIR, TOTAL_STEPS=bench.STEPS, MAX_COMPLETION_LEN=bench.MAX_COMPLETION_LEN, SAVE_STEPS=10_000,
        DECODE_EXPERTS=bench.DECODE_EXPERTS, DECODE_GRAPHS=bench.DECODE_GRAPHS, TRAIN_BATCH_SIZE=bench.TRAIN_BATCH_SIZE,
        TRAIN_TOKENS_PER_PASS=bench.TRAIN_TOKENS_PER_PASS)
    train_grpo.check_settings(settings)
    tokenizer = load_tokenizer()
    frame = train_grpo.load_training_data(settings, tokenizer)
    if bench.PROMPT_TOKENS:
        frame = lengthen_prompts(frame, tokenizer, bench.PROMPT_TOKENS)
    lengths = [len(tokenizer(p, add_special_tokens=False).input_ids) for p in frame["prompt"]]
    prompt_tokens = int(sum(lengths) / len(lengths))
    layout = train_grpo.batch_layout(settings, max(lengths))
    say(f"prompts: {len(frame)} rows, mean {prompt_tokens} tokens, longest {max(lengths)}; layout {layout}")
    model = build_random_model(attn_implementation="flex_attention", device=f"cuda:{local_rank()}")
    model.config.use_cache = True
    weight_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
    results = Path(bench.RESULTS)
    results.parent.mkdir(parents=True, exist_ok=True)
    step_timer = StepTimer(None, weight_bytes, prompt_tokens, results, bench, layout)
    dataset = train_grpo.build_stream(frame, settings).to_iterable_dataset()
    trainer = train_grpo.build_trainer(settings, model, tokenizer, dataset, layout, callbacks=[step_timer])
    step_timer.timer = GenerationTimer(model)  # outermost, around whichever generate() build_trainer installed
    trainer.train()
    if not is_main_process():
        return
    print(f"\n{stack_versions()}, {process_count()} process(es), sharding {step_timer.rows[0]['sharding']}")
    print(f"DECODE_EXPERTS={bench.DECODE_EXPERTS}, DECODE_GRAPHS={bench.DECODE_GRAPHS}, MAX_COMPLETION_LEN="
          f"{bench.MAX_COMPLETION_LEN}, prompt {prompt_tokens} tokens, {settings.NUM_GENERATIONS} generations x "
          f"{settings.GRADIENT_ACCUMULATION_STEPS} accumulation, {layout['train_batch_size']} completions a pass")
    print(f"{'step':>4}{'step s':>8}{'gen s':>8}{'train s':>8}{'gen %':>7}{'tok/s':>8}{'of limit':>9}"
          f"{'train MFU':>10}{'compl/s':>8}  peak GiB per GPU (reserved)")
    for r in step_timer.rows:
        print(f"{r['step']:>4}{r['step_s']:>8.1f}{r['generation_s']:>8.1f}{r['training_s']:>8.1f}"
              f"{100 * r['gen_share']:>6.0f}%{r['gen_tokens_per_s']:>8.0f}"
              f"{100 * r['gen_tokens_per_s'] / r['decode_limit_tokens_per_s']:>8.1f}%"
              f"{100 * r['train_mfu']:>9.1f}%{r['completions_per_s']:>8.2f}  "
              + " / ".join(f"{m:.1f}" for m in r["peak_gib_per_gpu"]) + f" ({r['reserved_gib']:.1f})")


if __name__ == "__main__":
    main()
