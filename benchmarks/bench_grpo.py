"""Real GRPO steps on a gpt-oss-20b-shaped model (random weights) through train_grpo.py's own wiring, timed.

Run on the GPU machine (the tokenizer folder must be reachable: GPT_OSS_TOKENIZER=<folder>):

    python benchmarks/bench_grpo.py --STEPS=2 --MAX_COMPLETION_LEN=512 --DECODE_EXPERTS=auto
    python benchmarks/bench_grpo.py --STEPS=2 --MAX_COMPLETION_LEN=512 --DECODE_GRAPHS=off  # transformers' generate
    python benchmarks/bench_grpo.py --STEPS=3 --MAX_COMPLETION_LEN=1024 --LORA_RHO=1e-3     # gap at a trained adapter
    python benchmarks/bench_grpo.py --STEPS=3 --MAX_COMPLETION_LEN=4000 --PROMPT_TOKENS=0 --EXPERTS=mxfp4 \
        --LORA_RHO=1e-3 --DECODE_LORA=merged   # or --SAMPLING_METRICS=0: the cost of exact LoRA / of the metrics
    python benchmarks/bench_grpo.py --STEPS=2 --MAX_COMPLETION_LEN=512 --EXPERTS=mxfp4      # resident MXFP4 experts
    python benchmarks/bench_grpo.py --STEPS=2 --MAX_COMPLETION_LEN=512 --MODEL_SIZE=120b    # gpt-oss-120b (H200)
    python benchmarks/bench_grpo.py --STEPS=4 --GENERATION_STEPS=2    # 2 steps' completions in one generation batch
    accelerate launch --config_file configs/accelerate/ddp.yaml benchmarks/bench_grpo.py --STEPS=2     # several GPUs
    accelerate launch --config_file configs/accelerate/fsdp2.yaml benchmarks/bench_grpo.py --STEPS=2   # sharded weights

It builds the 20B (or MODEL_SIZE's) architecture on the GPU (gpt_oss_shapes.py; EXPERTS: the experts as bf16
parameters, or resident MXFP4 blocks dequantized per layer as train_grpo's EXPERTS=auto loads them,
mxfp4_experts.py), takes the real TES prompts from data/,
and runs train_grpo.build_trainer(...).train() for STEPS optimizer steps at train_grpo's default batch settings
(64 completions a step). Random weights never emit an end token, so every completion runs to
MAX_COMPLETION_LEN: the worst case. Per step it prints generation and training time, completion tokens/s,
peak memory, the sampler-trainer gap (sampling_fidelity.py's metrics: mean |log p difference| and gen-KL estimate),
and the ratios to the limits (decode: the decode limit of the step's generate calls over its generation time,
decode_limit.py: the experts hit, the other weights and the KV cache at the mean cache length, at the copy rate
measured on this GPU at the start; training, train MFU: ~22 GFLOP a token a training second against the GPU's spec
dense bf16 peak, 989 TFLOP/s on an H100 SXM or an H200 (mfu.py; SPEC_TFLOPS for another GPU), and "+attn" with
attention's own matmuls counted too, grpo_timers.attention_gflop_per_row; then the same against BF16_TFLOPS, the
800 TFLOP/s bf16 matrix rate measured on an H100). GENERATION_STEPS=k
(train_grpo's) samples k steps' completions in one generation batch: the first step of each k generates (its row says
"new"), the others train on that batch ("reused", generation 0 s), and the mean step time over each k steps is
printed after the table, the figure to compare with GENERATION_STEPS=1; last, what torch.compile spent (the first
step's compilation, by function: timing.compilation_lines). Under accelerate launch every
process builds the model on its own GPU (FSDP then shards it) and runs train_grpo's per-process batch; rank 0
prints each step with the peak memory of every GPU and the completions per second of all of them together.
"""

from __future__ import annotations

import sys as _sys
from pathlib import Path as _Path

# Run as `python benchmarks/<name>.py` from the repo root: Python puts benchmarks/ on sys.path, not the root
# that holds train_grpo.py and the tes_grpo package.
_sys.path.insert(0, str(_Path(__file__).resolve().parents[1]))

import math
from pathlib import Path

from tes_grpo.run.processes import (
    is_main_process,
    local_rank,
    process_count,
    say,
    start_process_group,
)
from tes_grpo.run.script_config import resolve
from tes_grpo.training import memory_plan
from tes_grpo.training.batch_layout import batch_layout

STEPS = 2  # optimizer steps to time (the first includes compilation and warm-up); a multiple of GENERATION_STEPS
GENERATION_STEPS = 1  # train_grpo's GENERATION_STEPS: optimizer steps whose completions one generation batch samples
MAX_COMPLETION_LEN = 512  # tokens per completion (random weights always reach it)
DECODE_EXPERTS = "auto"  # train_grpo's DECODE_EXPERTS: auto | mxfp4 | grouped_mm | transformers
DECODE_GRAPHS = "auto"  # train_grpo's DECODE_GRAPHS: auto (on, on a GPU), on, off (transformers' generate)
TRAIN_EXPERTS = "auto"  # train_grpo's TRAIN_EXPERTS: auto (fused on a GPU), fused, transformers
TRAIN_GLUE = "auto"  # train_grpo's TRAIN_GLUE: auto (compiled on a GPU), compiled, eager (the libraries' forward)
MODEL_SIZE = "20b"  # gpt-oss shapes: 20b, or 120b (resident MXFP4 experts: ~61 GiB on the GPU; an H200)
EXPERTS = "bf16"  # the experts: bf16 parameters (as loaded with EXPERTS=bf16) or mxfp4 (resident, mxfp4_experts.py)
TRAIN_BATCH_SIZE = "auto"  # train_grpo's TRAIN_BATCH_SIZE: auto (from TRAIN_TOKENS_PER_PASS) or a number
TRAIN_TOKENS_PER_PASS = 40000  # train_grpo's auto micro-batch budget (tokens per forward/backward, worst case)
MEMORY_BUDGET_GB = 0.0  # train_grpo's MEMORY_BUDGET_GB; > 0 also caps this process there (a card of that size)
PROMPT_TOKENS = 1316  # lengthen each data/ prompt to about this many tokens (BENCHMARKS.md's length); 0 = as is
OUT_DIR = "runs/bench-grpo"  # run folder (adapter, logs) on the GPU machine
RESULTS = "runs/bench-grpo/results.jsonl"  # one JSON line per timed step is appended here
SPEC_TFLOPS = 0.0  # the GPU's spec dense bf16 peak (TFLOP/s), train MFU's denominator; 0: by its name (mfu.py)
BF16_TFLOPS = 800.0  # measured bf16 matrix rate of the H100 here (KINDS.md): the second, "of measured" MFU column
TRAIN_GFLOP_PER_TOKEN = 22.0  # forward + backward to activations + recomputation, 3.6 B active parameters
# MODEL_SIZE=120b: 36 layers x 128 experts, 5.1 B active parameters (OpenAI's model card): 6 x 5.1 GFLOP a token, and
# its experts exist only as resident MXFP4 (216 GiB in bf16)
PRESETS = {"MODEL_SIZE": {"120b": {"TRAIN_GFLOP_PER_TOKEN": 31.0, "EXPERTS": "mxfp4"}}}
PROFILE_TRAIN = False  # after the steps, profile one forward/backward of the last micro-batch (torch.profiler)
LORA_RHO = 0.0  # >0: the adapter starts with B drawn so rms(delta) / rms(W) = this (a trained adapter; 0: PEFT's zeros)
IMPORTANCE_SAMPLING = "off"  # train_grpo's IMPORTANCE_SAMPLING: off, token_truncate, ... (cap: train_grpo's default)
DECODE_LORA = "peft"  # train_grpo's DECODE_LORA: peft (the trainer's order) or merged (folded into a weight copy)
DECODE_GLUE = "auto"  # train_grpo's DECODE_GLUE: auto, eager or compiled (the decode step's glue fused on CUDA)
SAMPLING_METRICS = True  # False: the trainer without sampling_fidelity's measurement, to time what it costs
EVAL_STEPS = 0  # train_grpo's EVAL_STEPS: evaluate every this many steps and time it (0 = off, the step figures alone)
EVAL_PROMPTS = 4  # train_grpo's EVAL_PROMPTS: held-out prompts an evaluation takes
EVAL_SAMPLES = 16  # train_grpo's EVAL_SAMPLES: completions per held-out prompt (4 x 16: one generation batch)


_FILLER = " Serve the cooling load first; among the ways to serve it, prefer the one with the least CO2."


def lengthen_prompts(frame, tokenizer, target: int):
    """Pads each prompt's developer message with a repeated note until the prompt is about `target` tokens.

    The repo's TES prompts are ~850 tokens; the measurements in BENCHMARKS.md used ~1,316-token prompts. Cost
    depends on length, not content (random weights), so padding makes the figures comparable.
    """
    per_filler = len(tokenizer(_FILLER, add_special_tokens=False).input_ids)
    marker = "<|end|><|start|>user"

    def pad(prompt: str) -> str:
        missing = target - len(tokenizer(prompt, add_special_tokens=False).input_ids)
        if missing <= 0 or marker not in prompt:
            return prompt
        head, _, tail = prompt.partition(marker)
        return head + "\n\nNotes:" + _FILLER * (missing // per_filler) + marker + tail

    frame = frame.copy()
    frame["prompt"] = frame["prompt"].map(pad)
    return frame


def keep_last_loss_inputs(trainer) -> list:
    """Wraps trainer.compute_loss to keep the inputs of its latest call (one micro-batch, generation done)."""
    kept, original = [], trainer.compute_loss

    def compute_loss(model, inputs, *args, **kwargs):
        kept[:] = [inputs]
        return original(model, inputs, *args, **kwargs)

    trainer.compute_loss = compute_loss
    return kept


# the first pattern a kernel's name contains names its group (profile_micro_batch's table by group)
KERNEL_GROUPS = (
    ("attention backward", ("flex_attention_backward",)),
    ("attention forward", ("flex_attention",)),
    ("matrix products", ("gemm", "cutlass", "nvjet", "xmma", "cublas", "matmul")),
    ("copies and casts", ("copy", "memcpy", "catarray", "fill")),
    ("compiled or Triton kernels", ("triton_",)),
    ("eager elementwise and reductions", ("at::native", "elementwise", "reduce_kernel")),
)


def kernel_group(name: str) -> str:
    """The group of a profiled kernel, by the first KERNEL_GROUPS pattern its (lower-cased) name contains."""
    lowered = name.lower()
    for group, patterns in KERNEL_GROUPS:
        if any(p in lowered for p in patterns):
            return group
    return "other"


def profile_micro_batch(trainer, inputs) -> None:
    """One forward/backward of a kept micro-batch under torch.profiler: the forward's and the backward's wall time,
    GPU-busy time, the kernels' time by group (KERNEL_GROUPS), then the kernels by GPU time (what the training part of
    a step is made of). Gradients are zeroed after."""
    import time

    import torch
    from torch.profiler import ProfilerActivity, profile

    model = trainer.model
    model.train()
    for _ in range(2):  # first run: anything left to compile or allocate
        # CUDA activity only, so every event is a kernel: the CPU + CUDA trace filtered by zero CPU time printed an
        # empty table in the 2026-11-24 run (logs/grpo-1024-fused.log)
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            torch.cuda.synchronize()
            start = time.perf_counter()
            loss = trainer.compute_loss(model, inputs)
            torch.cuda.synchronize()
            forward = time.perf_counter() - start
            trainer.accelerator.backward(loss)
            torch.cuda.synchronize()
            wall = time.perf_counter() - start
    model.zero_grad(set_to_none=True)
    events = prof.key_averages()
    kernels = [e for e in events if e.self_device_time_total > 0]
    gpu_us = sum(e.self_device_time_total for e in kernels)
    rows = int(inputs["completion_ids"].shape[0])
    tokens = int(inputs["completion_ids"].numel() + inputs["prompt_ids"].numel())
    print(f"\nprofile of one micro-batch ({rows} rows, {tokens} tokens incl. padding): wall {wall:.2f} s (forward "
          f"{forward:.2f} s, backward with recomputation {wall - forward:.2f} s), GPU busy {gpu_us / 1e6:.2f} s "
          f"({100 * gpu_us / 1e6 / wall:.0f}%)")
    groups: dict[str, list[float]] = {}
    for e in kernels:
        group = groups.setdefault(kernel_group(e.key), [0.0, 0])
        group[0] += e.self_device_time_total
        group[1] += e.count
    print(f"{'GPU ms':>9}{'share':>7}{'calls':>7}  group")
    for name, (us, calls) in sorted(groups.items(), key=lambda g: -g[1][0]):
        print(f"{us / 1e3:>9.1f}{100 * us / gpu_us:>6.1f}%{calls:>7}  {name}")
    print(f"{'GPU ms':>9}{'share':>7}{'calls':>7}  kernel")
    for e in sorted(kernels, key=lambda e: -e.self_device_time_total)[:40]:
        print(f"{e.self_device_time_total / 1e3:>9.1f}{100 * e.self_device_time_total / gpu_us:>6.1f}%{e.count:>7}  "
              f"{e.key[:110]}")


def decode_shape(calls) -> tuple[int, float]:
    """(sequences of a generate call, mean cache length over all calls' decode steps) of GenerationTimer.calls, for
    printing the bytes of a typical decode step."""
    steps = sum(max(new - 1, 0) for _, _, new in calls)
    if not steps:
        return (calls[0][0] if calls else 0), 0.0
    return calls[0][0], sum((new - 1) * (prompt + new / 2) for _, prompt, new in calls) / steps


def main(argv: list[str] | None = None) -> None:
    bench = resolve(globals(), argv, presets=PRESETS)
    if bench.MODEL_SIZE not in ("20b", "120b") or bench.EXPERTS not in ("bf16", "mxfp4"):
        raise SystemExit(f"error: MODEL_SIZE={bench.MODEL_SIZE!r} / EXPERTS={bench.EXPERTS!r}: 20b or 120b / bf16 or "
                         "mxfp4")
    if bench.GENERATION_STEPS < 1 or bench.STEPS % bench.GENERATION_STEPS:
        raise SystemExit(f"error: STEPS={bench.STEPS}: must be a multiple of GENERATION_STEPS={bench.GENERATION_STEPS} "
                         "(>= 1), so every timed generation batch is trained to its end")
    if bench.SPEC_TFLOPS < 0:
        raise SystemExit(f"error: SPEC_TFLOPS={bench.SPEC_TFLOPS}: the GPU's dense bf16 peak in TFLOP/s, or 0 to look "
                         "it up by the GPU's name (mfu.SPEC_BF16_TFLOPS)")
    import torch

    import train_grpo
    from benchmarks import mfu
    from benchmarks.decode_limit import DecodeLimit, copy_rate_line, experts_format, measure_copy_rate
    from benchmarks.grpo_timers import GenerationTimer, StepTimer, generation_cycles
    from benchmarks.log_header import header
    from data_reward import EVAL_RECORD_COLUMNS
    from tes_grpo.model.gpt_oss_shapes import build_random_model, stack_versions
    from tes_grpo.run.evaluation import eval_dataset
    from tes_grpo.run.oom import use_expandable_segments
    from tes_grpo.sampling.sampling_fidelity import GEN_KL, LOGP_MAX, LOGP_MEAN
    from tes_grpo.training import fast_paths

    allocator = []  # its line goes after the header, which starts CUDA: the setting must come first
    use_expandable_segments(allocator.append, torch.cuda.is_available(), torch.cuda.is_initialized())  # as train_grpo
    start_process_group()
    torch.cuda.set_device(local_rank())
    copy_rate = measure_copy_rate()  # before the model: the copy's 2 GiB are free now
    if is_main_process():  # one header, as say() prints; the other ranks need not ask git
        print(header(copy_rate=copy_rate), flush=True)
    for line in allocator:
        say(line)
    spec_tflops, spec_source = mfu.spec_peak(torch.cuda.get_device_name(), bench.SPEC_TFLOPS)
    from tes_grpo.task.harmony import load_tokenizer

    settings = train_grpo.default_settings(
        OUT_DIR=bench.OUT_DIR, TOTAL_STEPS=bench.STEPS, MAX_COMPLETION_LEN=bench.MAX_COMPLETION_LEN,
        SAVE_STEPS=10_000 * bench.GENERATION_STEPS, GENERATION_STEPS=bench.GENERATION_STEPS,  # no checkpoint
        DECODE_EXPERTS=bench.DECODE_EXPERTS, DECODE_GRAPHS=bench.DECODE_GRAPHS, TRAIN_EXPERTS=bench.TRAIN_EXPERTS,
        TRAIN_GLUE=bench.TRAIN_GLUE, TRAIN_BATCH_SIZE=bench.TRAIN_BATCH_SIZE,
        TRAIN_TOKENS_PER_PASS=bench.TRAIN_TOKENS_PER_PASS, IMPORTANCE_SAMPLING=bench.IMPORTANCE_SAMPLING,
        MEMORY_BUDGET_GB=bench.MEMORY_BUDGET_GB, DECODE_LORA=bench.DECODE_LORA, DECODE_GLUE=bench.DECODE_GLUE,
        EVAL_STEPS=bench.EVAL_STEPS, EVAL_AT_START=False, EVAL_PROMPTS=bench.EVAL_PROMPTS,
        EVAL_SAMPLES=bench.EVAL_SAMPLES)
    if not bench.SAMPLING_METRICS and bench.IMPORTANCE_SAMPLING != "off":
        raise SystemExit("error: SAMPLING_METRICS=0 times the trainer without the measurement; IMPORTANCE_SAMPLING "
                         "needs it (set it off)")
    train_grpo.check_settings(settings)
    tokenizer = load_tokenizer()
    frame = train_grpo.load_training_data(settings, tokenizer)
    if bench.PROMPT_TOKENS:
        frame = lengthen_prompts(frame, tokenizer, bench.PROMPT_TOKENS)
    lengths = [len(tokenizer(p, add_special_tokens=False).input_ids) for p in frame["prompt"]]
    prompt_tokens = int(sum(lengths) / len(lengths))
    if bench.MEMORY_BUDGET_GB:  # the process behaves like a card of this size: allocations past it fail
        torch.cuda.set_per_process_memory_fraction(
            min(1.0, bench.MEMORY_BUDGET_GB * 2**30 / torch.cuda.get_device_properties(local_rank()).total_memory))
    model = build_random_model(attn_implementation="flex_attention", device=f"cuda:{local_rank()}",
                               size=bench.MODEL_SIZE, resident=bench.EXPERTS == "mxfp4")
    plan = memory_plan.plan_run(settings, model.config, max(lengths), None, bench.EXPERTS == "mxfp4", loaded=True,
                                say=say)
    layout = batch_layout(settings, max(lengths), None, plan)
    say(f"prompts: {len(frame)} rows, mean {prompt_tokens} tokens, longest {max(lengths)}; layout {layout}")
    if bench.EXPERTS == "mxfp4":
        from tes_grpo.experts.mxfp4_experts import ResidentSummary, residency_line

        say(residency_line(ResidentSummary.of(model)))
    model.config.use_cache = True
    results = Path(bench.RESULTS)
    results.parent.mkdir(parents=True, exist_ok=True)
    step_timer = StepTimer(None, None, prompt_tokens, results, bench, layout, model.config)
    dataset = train_grpo.build_stream(frame, settings).to_iterable_dataset()
    eval_frame = train_grpo.load_eval_data(settings, tokenizer)  # None when EVAL_STEPS=0
    held_out = None if eval_frame is None else eval_dataset(eval_frame, EVAL_RECORD_COLUMNS)
    trainer = train_grpo.build_trainer(settings, model, tokenizer, dataset, layout, callbacks=[step_timer],
                                       measure_gap=bench.SAMPLING_METRICS, eval_dataset=held_out)
    step_timer.fidelity = trainer.gap
    step_timer.spec_tflops = spec_tflops
    step_timer.timer = GenerationTimer(trainer.sampler)  # around the trainer's sampler, whichever it built
    trainer.sampler = step_timer.timer
    # the sampler build_trainer built, decided again (the same settings, model and machine give the same choice)
    spec = fast_paths.choose(settings, trainer, torch.cuda.is_available(), layout["generation_sequences"]).sampler
    decode_experts = spec.experts if spec.backend == "graph_decode" else "model"
    step_timer.limit = DecodeLimit(model.config, experts_format(decode_experts, bench.EXPERTS == "mxfp4"),
                                   settings.LORA_R, copy_rate)
    if bench.LORA_RHO:
        from benchmarks.decode_compare import draw_lora_b

        draw_lora_b(trainer.model, bench.LORA_RHO)
    last_batch = keep_last_loss_inputs(trainer) if bench.PROFILE_TRAIN else None
    trainer.train()
    if last_batch and is_main_process():
        profile_micro_batch(trainer, last_batch[0])
    if not is_main_process():
        return
    print(f"\n{stack_versions()}, {process_count()} process(es), sharding {step_timer.rows[0]['sharding']}")
    print(f"gpt-oss-{bench.MODEL_SIZE} shapes, EXPERTS={bench.EXPERTS}, DECODE_EXPERTS={bench.DECODE_EXPERTS}, "
          f"DECODE_GRAPHS={bench.DECODE_GRAPHS}, TRAIN_EXPERTS={bench.TRAIN_EXPERTS}, TRAIN_GLUE={bench.TRAIN_GLUE}, "
          f"LORA_RHO={bench.LORA_RHO}, "
          f"IMPORTANCE_SAMPLING={bench.IMPORTANCE_SAMPLING}, DECODE_LORA={bench.DECODE_LORA}, "
          f"DECODE_GLUE={bench.DECODE_GLUE}, "
          f"SAMPLING_METRICS={bench.SAMPLING_METRICS}, MAX_COMPLETION_LEN="
          f"{bench.MAX_COMPLETION_LEN}, prompt {prompt_tokens} tokens, {settings.NUM_GENERATIONS} generations x "
          f"{settings.GRADIENT_ACCUMULATION_STEPS} accumulation, {layout['train_batch_size']} completions a pass, "
          f"GENERATION_STEPS={bench.GENERATION_STEPS} ({layout['generation_batch']} completions a generation batch)")
    for line in step_timer.limit.bytes(*decode_shape(step_timer.timer.calls)).lines(copy_rate):
        print(line)
    print(f"{copy_rate_line(copy_rate, torch.cuda.get_device_name())}; 'limit s': the decode limit of a step's "
          "decode steps, each at its cache length; 'of limit': that over the step's generation seconds (prefill "
          "included)")
    print(mfu.explanation(spec_tflops, spec_source, bench.TRAIN_GFLOP_PER_TOKEN, bench.BF16_TFLOPS))
    print(f"{'step':>4}{'batch':>7}{'step s':>8}{'gen s':>8}{'train s':>8}{'gen %':>7}{'tok/s':>8}{'limit s':>8}"
          f"{'of limit':>9}"
          f"{mfu.COLUMNS}{'compl/s':>8}{'logp gap':>10}{'max gap':>9}{'gen KL':>10}"
          "  peak GiB per GPU (reserved)")
    for r in step_timer.rows:
        print(f"{r['step']:>4}{'new' if r['generated'] else 'reused':>7}{r['step_s']:>8.1f}{r['generation_s']:>8.1f}"
              f"{r['training_s']:>8.1f}"
              f"{100 * r['gen_share']:>6.0f}%{r['gen_tokens_per_s']:>8.0f}{r['decode_limit_s']:>8.1f}"
              f"{100 * r['decode_limit_share']:>8.1f}%"
              f"{mfu.cells(r)}"
              f"{r['completions_per_s']:>8.2f}{r.get(LOGP_MEAN, math.nan):>10.2e}{r.get(LOGP_MAX, math.nan):>9.2e}"
              f"{r.get(GEN_KL, math.nan):>10.2e}  "
              + " / ".join(f"{m:.1f}" for m in r["peak_gib_per_gpu"]) + f" ({r['reserved_gib']:.1f})")
    cycles = generation_cycles(step_timer.rows)
    print(f"mean step time per generation batch (GENERATION_STEPS={bench.GENERATION_STEPS}; the first includes "
          "compilation and warm-up): " + ", ".join(f"steps {c['first']}-{c['last']} {c['mean_step_s']:.1f} s"
                                                    for c in cycles))
    steady = [r for r in step_timer.rows if r["step"] > cycles[0]["last"]] or step_timer.rows
    print(f"mean step time over steps {steady[0]['step']}-{steady[-1]['step']}: "
          f"{sum(r['step_s'] for r in steady) / len(steady):.1f} s"
          + ("" if len(cycles) > 1 else " (one generation batch only: warm-up included)"))
    evaluations = [r for r in trainer.state.log_history if "eval_runtime" in r]
    for r in evaluations:  # outside the steps' times: an evaluation runs between two steps
        warm = sum(x["step_s"] for x in steady) / len(steady)
        share = r["eval_runtime"] / (r["eval_runtime"] + bench.EVAL_STEPS * warm)
        print(f"evaluation after step {r['step']}: {r['eval_runtime']:.1f} s for {bench.EVAL_PROMPTS} x "
              f"{bench.EVAL_SAMPLES} completions ({share:.1%} of an interval of EVAL_STEPS={bench.EVAL_STEPS} "
              f"steps at the warm step above); eval valid {r.get('eval_action/valid_fraction', math.nan):.2f}, optimal "
              f"{r.get('eval_action/optimal_fraction', math.nan):.2f}")
    from torch._dynamo.utils import get_compilation_metrics

    from benchmarks.timing import compilation_lines
    for line in compilation_lines(get_compilation_metrics()):
        print(line)


if __name__ == "__main__":
    main()
