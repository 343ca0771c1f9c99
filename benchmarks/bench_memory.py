"""Peak GPU memory of one GRPO training pass (forward + backward) on a gpt-oss-20b-shaped model, per micro-batch
size and completion length, with TRL's fused LM head and with whole logits, against memory_estimate.py's estimate;
prints the ACTIVATION_SCALE that calibrates the estimate. Run on the GPU machine (the tokenizer folder must be
reachable: GPT_OSS_TOKENIZER=<folder>), ~4 min on an H100:

    python benchmarks/bench_memory.py                                   # the whole table, then the calibration
    python benchmarks/bench_memory.py --HEADS=fused --COMPLETION_LENS=4000   # calibration points only
    python benchmarks/bench_memory.py --MEMORY_BUDGET_GB=50             # also: plan for 50 GiB, run it capped there

It builds the 20B architecture in bf16 on the GPU (gpt_oss_shapes.py; 39 GiB), wires it exactly as train_grpo
trains (train_grpo.build_trainer: LoRA r 4, fused experts, flex attention with padding bounds, gradient
checkpointing as the Trainer switches it on) and, per case, calls the trainer's own compute_loss + backward on
random token ids (rows x (PROMPT_TOKENS + completion)), with the allocator's peak reset before. "full" replaces
TRL's fused head by the whole logits (the trainer's full_logits: what TRL did before its fused head); cases the
estimate says cannot fit the free memory are skipped, and an out-of-memory error is recorded as OOM. The last lines
are a table (peak above the memory held before the pass, the estimate, their ratio) and the least-squares
ACTIVATION_SCALE over the fused cases: set memory_estimate.ACTIVATION_SCALE to it.

MEMORY_BUDGET_GB > 0 then plans train_grpo's default step (64 completions) for that budget with the memory held
now, caps this process at the budget (torch.cuda.set_per_process_memory_fraction, as a card of that size), and
runs the planned pass: its peak must stay under the budget.

FSDP_TABLE=1 prints, without a GPU and without running anything, what each GPU must hold for the weights of
gpt-oss-20b and -120b (LoRA r 4), experts resident as MXFP4 or bf16: on one GPU or under DDP (the whole model:
memory_estimate.weights_bytes and LoRA's optimizer state; with bf16 experts also DECODE_EXPERTS=auto's MXFP4 decode
copy) and under FSDP2 over 1, 2, 4 and 8 GPUs (memory_estimate.fsdp_weights_per_gpu), which card sizes hold that
before any activations, and with bf16 experts the fewest GPUs of each size FSDP2 needs
(memory_estimate.fewest_fsdp_processes):

    python benchmarks/bench_memory.py --FSDP_TABLE=1
"""

from __future__ import annotations

import sys as _sys
from pathlib import Path as _Path

_sys.path.insert(0, str(_Path(__file__).resolve().parents[1]))

import gc
import json
import sys
import time
from pathlib import Path

from tes_grpo.run.script_config import resolve

ROWS = [1, 2, 4, 8]  # completions a pass (micro-batch sizes) to measure
COMPLETION_LENS = [1024, 4000]  # tokens per completion
PROMPT_TOKENS = 1316  # tokens per prompt (the longest prompt of BENCHMARKS.md's 4,000-token worst case)
HEADS = ["fused", "full"]  # LM head: fused = TRL 1.16's tiles; full = whole logits through log-softmax
GRADIENT_CHECKPOINTING = True  # train_grpo's GRADIENT_CHECKPOINTING
TRAIN_EXPERTS = "auto"  # train_grpo's TRAIN_EXPERTS (auto: fused on a GPU with Triton)
MEMORY_BUDGET_GB = 0.0  # > 0: plan the default step for this budget and run the planned pass capped at it
OUT_DIR = "runs/bench-memory"  # the trainer's output folder (nothing is trained or saved)
RESULTS = "runs/bench-memory/results.jsonl"  # one JSON line per case is appended here
FSDP_TABLE = False  # print the weights a GPU holds (DDP, FSDP2 over 1-8 GPUs; 20B, 120B) and stop; no GPU needed
CARDS_GB = [24, 40, 48, 80, 141]  # card sizes of FSDP_TABLE, in GB (10**9 bytes: the least a card sold so has)


def enable_checkpointing(trainer) -> None:
    """Gradient checkpointing as Trainer.train() switches it on (transformers 5.24 renamed it activation
    checkpointing; 5.17 has only the old name)."""
    model = trainer.model.get_base_model()
    kwargs = trainer.args.gradient_checkpointing_kwargs
    if hasattr(model, "activation_checkpointing_enable"):
        model.activation_checkpointing_enable(activation_checkpointing_kwargs=kwargs)
    else:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs=kwargs)


def loss_inputs(rows: int, prompt: int, completion: int, seed: int, device) -> dict:
    """A micro-batch as TRL hands it to compute_loss: random ids, no padding (the worst case), random advantages."""
    import torch

    g = torch.Generator(device=device).manual_seed(seed)
    return {"prompt_ids": torch.randint(0, 200_000, (rows, prompt), device=device, generator=g),
            "prompt_mask": torch.ones(rows, prompt, dtype=torch.long, device=device),
            "completion_ids": torch.randint(0, 200_000, (rows, completion), device=device, generator=g),
            "completion_mask": torch.ones(rows, completion, dtype=torch.long, device=device),
            "advantages": torch.randn(rows, device=device, generator=g)}


def pass_peak(trainer, inputs) -> int | None:
    """Bytes allocated at the peak of one compute_loss + backward above what was allocated before it; None when
    it ran out of memory."""
    import torch

    model = trainer.model
    model.zero_grad(set_to_none=True)
    gc.collect()
    torch.cuda.empty_cache()
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    before = torch.cuda.memory_allocated()
    try:
        trainer.accelerator.backward(trainer.compute_loss(model, inputs))
        torch.cuda.synchronize()
    except torch.cuda.OutOfMemoryError:
        return None
    finally:
        model.zero_grad(set_to_none=True)
    return torch.cuda.max_memory_allocated() - before


def calibration(rows: list[dict]) -> tuple[float, float, float] | None:
    """(ACTIVATION_SCALE, fitted fixed GiB, fitted scale) from the fused cases: measured - head tile = scale x
    derived activations through the origin, and the same with a fixed part, by least squares."""
    points = [(r["derived_activation_bytes"], r["peak_bytes"] - r["head_bytes"]) for r in rows
              if r["head"] == "fused" and r["peak_bytes"] is not None]
    if len(points) < 2:
        return None
    through_origin = sum(a * m for a, m in points) / sum(a * a for a, _ in points)
    n, sa, sm = len(points), sum(a for a, _ in points), sum(m for _, m in points)
    saa, sam = sum(a * a for a, _ in points), sum(a * m for a, m in points)
    slope = (n * sam - sa * sm) / (n * saa - sa * sa) if n * saa != sa * sa else through_origin
    return through_origin, (sm - slope * sa) / n / 2**30, slope


def run_budget(s, trainer, shape, settings) -> dict:
    """Plans train_grpo's default step for MEMORY_BUDGET_GB with the memory held now, caps this process there and
    runs the planned pass; returns the plan's line and the measured peak (GiB, whole process)."""
    import torch

    from tes_grpo.training import memory_plan

    budgeted = settings.replace(MEMORY_BUDGET_GB=s.MEMORY_BUDGET_GB, MAX_COMPLETION_LEN=max(s.COMPLETION_LENS))
    trainable = sum(p.numel() for p in trainer.model.parameters() if p.requires_grad)
    facts = memory_plan.MemoryFacts.measured(trainable_params=trainable)
    plan = memory_plan.plan_memory(budgeted, shape, s.PROMPT_TOKENS, facts)
    print(plan.describe(), flush=True)
    torch.cuda.set_per_process_memory_fraction(s.MEMORY_BUDGET_GB * 2**30 / facts.total_bytes)
    inputs = loss_inputs(plan.train_batch_size, s.PROMPT_TOKENS, budgeted.MAX_COMPLETION_LEN, 99, trainer.model.device)
    extra = pass_peak(trainer, inputs)
    torch.cuda.set_per_process_memory_fraction(1.0)
    peak = None if extra is None else (extra + facts.held_bytes) / 2**30
    return {"plan": plan.describe(), "rows": plan.train_batch_size, "peak_gib": peak}


def weights_table(cards_gb=CARDS_GB, lora_r: int = 4) -> str:
    """FSDP_TABLE's lines: per model, experts and layout, the weights a GPU holds and what it needs before any
    activations (the weights and, with resident experts, one layer's experts dequantized for training: what
    memory_plan checks under FSDP; on one GPU with bf16 experts, graph_decode's MXFP4 decode copy instead), and for
    each card size whether that fits."""
    from tes_grpo.model.gpt_oss_shapes import SIZES, gpt_oss_config
    from tes_grpo.training import memory_estimate

    gib = memory_estimate.gib
    lines = [f"{'model':<6}{'experts':<8}{'layout':<14}{'weights GiB':>12}{'needs GiB':>10}  "
             + " ".join(f"{c:>3}GB" for c in cards_gb)]
    for size in SIZES:
        m = memory_estimate.ModelShape.from_config(gpt_oss_config(size))
        for resident in (True, False):
            whole = (memory_estimate.weights_bytes(m, experts_mxfp4=resident)
                     + memory_estimate.lora_params(m, lora_r) * memory_estimate.OPTIMIZER_BYTES_PER_PARAM)
            # what the one-GPU plan adds (recipe_facts): a dequantized expert layer, or the MXFP4 decode copy
            extra = memory_estimate.expert_layer_bytes(m) if resident else memory_estimate.expert_bytes(m, mxfp4=True)
            rows = [("1 GPU / DDP", whole, whole + extra)]
            for n in (1, 2, 4, 8):
                w = memory_estimate.fsdp_weights_per_gpu(m, n, resident, lora_r)
                rows.append((f"FSDP2 x {n}", w.weights_bytes, w.needs_bytes))
            for layout, weights, needs in rows:
                fits = " ".join(f"{'yes' if needs <= c * 10**9 else 'no':>5}" for c in cards_gb)
                lines.append(f"{size:<6}{'mxfp4' if resident else 'bf16':<8}{layout:<14}{gib(weights):>12}"
                             f"{gib(needs):>10}  {fits}")
        fewest = [memory_estimate.fewest_fsdp_processes(m, False, lora_r, c * 10**9) for c in cards_gb]
        lines.append(f"{size:<6}{'bf16':<8}{'FSDP2, fewest GPUs':<36}  " + " ".join(f"{n or '-':>5}" for n in fewest))
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    s = resolve(globals(), argv)
    from benchmarks.log_header import header

    print(header(), flush=True)
    if s.FSDP_TABLE:
        print(weights_table(s.CARDS_GB))
        return 0
    import torch

    import train_grpo
    from tes_grpo.model.gpt_oss_shapes import build_random_model, stack_versions
    from tes_grpo.task.harmony import load_tokenizer
    from tes_grpo.training import memory_estimate, memory_plan
    from tes_grpo.training.batch_layout import batch_layout
    from tes_grpo.training.lm_head import describe_lm_head, fused_head_tile

    # each (rows, length) is a new shape for torch.compile's flex attention; past the default recompile limit (8)
    # flex attention would run unfused, holding the whole score matrix, which is not what training does
    torch._dynamo.config.recompile_limit = 64
    settings = train_grpo.default_settings(
        OUT_DIR=s.OUT_DIR, TOTAL_STEPS=1, SAVE_STEPS=10_000, MAX_COMPLETION_LEN=max(s.COMPLETION_LENS),
        TRAIN_EXPERTS=s.TRAIN_EXPERTS, GRADIENT_CHECKPOINTING=s.GRADIENT_CHECKPOINTING)
    train_grpo.check_settings(settings)
    tokenizer = load_tokenizer()
    frame = train_grpo.load_training_data(settings, tokenizer)
    layout = batch_layout(settings, s.PROMPT_TOKENS)
    model = build_random_model(attn_implementation="flex_attention", device="cuda")
    model.config.use_cache = True
    shape = memory_estimate.ModelShape.from_config(model.config)
    dataset = train_grpo.build_stream(frame, settings).to_iterable_dataset()
    trainer = train_grpo.build_trainer(settings, model, tokenizer, dataset, layout)
    if s.GRADIENT_CHECKPOINTING:
        enable_checkpointing(trainer)
    trainer.model.train()
    # what the training loop sets before each micro-step; dr_grpo's loss divides by it
    trainer.current_gradient_accumulation_steps = trainer.args.gradient_accumulation_steps
    print(describe_lm_head(trainer.model), flush=True)
    tile = fused_head_tile()

    start = time.perf_counter()
    device = trainer.model.device
    warm = pass_peak(trainer, loss_inputs(1, s.PROMPT_TOKENS, min(s.COMPLETION_LENS), 0, device))  # compiles
    print(f"warm-up pass (compilation): {time.perf_counter() - start:.0f} s, peak "
          f"{(warm or 0) / 2**30:.2f} GiB above the weights", flush=True)
    results = Path(s.RESULTS)
    results.parent.mkdir(parents=True, exist_ok=True)
    rows = []
    for head in s.HEADS:
        trainer.full_logits = head == "full"
        for completion in s.COMPLETION_LENS:
            for n in s.ROWS:
                head_tile = tile if head == "fused" else None
                estimate = memory_estimate.train_pass_bytes(shape, n, s.PROMPT_TOKENS, completion,
                                                        s.GRADIENT_CHECKPOINTING, head_tile=head_tile)
                head_bytes = memory_estimate.lm_head_bytes(shape, n, completion, head_tile=head_tile)
                derived = memory_estimate.train_pass_bytes(shape, n, s.PROMPT_TOKENS, completion,
                                                       s.GRADIENT_CHECKPOINTING, scale=1.0)
                activations = derived - memory_estimate.lm_head_bytes(shape, n, completion)
                free = memory_plan.MemoryFacts.measured().free_bytes
                row = {"head": head, "rows": n, "prompt": s.PROMPT_TOKENS, "completion": completion,
                       "tokens": n * (s.PROMPT_TOKENS + completion), "estimate_bytes": estimate,
                       "derived_activation_bytes": activations, "head_bytes": head_bytes, "peak_bytes": None,
                       "note": ""}
                if estimate > free:
                    row["note"] = f"skipped: est. {estimate / 2**30:.1f} GiB > {free / 2**30:.1f} GiB free"
                else:
                    started = time.perf_counter()
                    row["peak_bytes"] = pass_peak(trainer, loss_inputs(n, s.PROMPT_TOKENS, completion, n, device))
                    row["seconds"] = round(time.perf_counter() - started, 1)
                    row["note"] = "OOM" if row["peak_bytes"] is None else ""
                rows.append(row)
                with results.open("a") as out:
                    out.write(json.dumps(row) + "\n")
                print(row, flush=True)
    trainer.full_logits = False
    budget = run_budget(s, trainer, shape, settings) if s.MEMORY_BUDGET_GB > 0 else None

    print(f"\n{stack_versions()}")
    print(f"gpt-oss-20b shape, bf16, LoRA r 4, checkpointing {s.GRADIENT_CHECKPOINTING}, TRAIN_EXPERTS="
          f"{s.TRAIN_EXPERTS}, prompt {s.PROMPT_TOKENS} tokens, no padding; peak = allocated above the weights")
    print(f"{'head':<6}{'rows':>5}{'completion':>11}{'tokens':>8}{'peak GiB':>10}{'est GiB':>9}{'peak/est':>9}"
          f"{'KiB/token':>10}  note")
    for r in rows:
        peak, est = r["peak_bytes"], r["estimate_bytes"]
        measured = f"{peak / 2**30:>10.2f}{est / 2**30:>9.2f}{peak / est:>9.2f}{peak / r['tokens'] / 1024:>10.0f}" \
            if peak is not None else f"{'-':>10}{est / 2**30:>9.2f}{'-':>9}{'-':>10}"
        print(f"{r['head']:<6}{r['rows']:>5}{r['completion']:>11}{r['tokens']:>8}{measured}  {r['note']}")
    fit = calibration(rows)
    if fit:
        scale, fixed, slope = fit
        per_token = sum(v for k, v in memory_estimate.train_token_terms(shape, s.GRADIENT_CHECKPOINTING).items()
                        if k != "per_completion_token")
        print(f"calibration over the fused cases: ACTIVATION_SCALE = {scale:.3f} (memory_estimate.py has "
              f"{memory_estimate.ACTIVATION_SCALE}; derived {per_token / 1024:.0f} KiB a token + "
              f"{memory_estimate.train_token_terms(shape, True)['per_completion_token'] / 1024:.1f} KiB a completion "
              f"token); with a fixed part: {fixed:+.2f} GiB + {slope:.3f} x derived")
    if budget:
        peak = "OOM" if budget["peak_gib"] is None else f"{budget['peak_gib']:.1f} GiB"
        print(f"MEMORY_BUDGET_GB={s.MEMORY_BUDGET_GB:g}: planned {budget['rows']} completions a pass; whole-process "
              f"peak {peak} under the {s.MEMORY_BUDGET_GB:g} GiB cap\n  {budget['plan']}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
