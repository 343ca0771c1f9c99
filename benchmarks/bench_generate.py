"""Generation throughput of a gpt-oss-20b-shaped model (random weights) on one GPU, per experts and decode path.

Run on the GPU machine (the numbers go to BENCHMARKS.md):

    python benchmarks/bench_generate.py --NUM_SEQS=64 --NEW_TOKENS=128
    python benchmarks/bench_generate.py --NEW_TOKENS=128 --VARIANTS=grouped_mm,static,graphs --COMPARE_SEQS=8
    python benchmarks/bench_generate.py --NUM_PROMPTS=4 --PROMPT_LEN_SPREAD=40 --VARIANTS=graphs_unshared,graphs
    python benchmarks/bench_generate.py --NUM_PROMPTS=4 --NEW_TOKENS=8 --VARIANTS=graphs --RECOMPILE_LENGTHS=20
    python benchmarks/bench_generate.py --NUM_PROMPTS=4 --PROMPT_LEN_SPREAD=40 --NEW_TOKENS=1024 --LORA_R=4 \
        --LORA_RHO=1e-3 --VARIANTS=graphs_mxfp4,graphs_mxfp4_merged --COMPARE_SEQS=4 --COMPARE_TOKENS=32

It builds the 20B architecture in bf16 straight on the GPU (no download), then times generation (prefill
included) for each variant in VARIANTS. `default` is transformers' generate as shipped, which switches `grouped_mm`
experts to `batched_mm` while decoding; `grouped_mm` keeps grouped GEMM throughout (see
`patches.transformers_patches.grouped_mm_experts_for_decode`); `static` is graph_decode.py's decode loop without CUDA
graphs and `graphs` the same with each decode step replayed as a CUDA graph (train_grpo's DECODE_GRAPHS); both
prefill each distinct prompt once, `static_unshared` / `graphs_unshared` prefill every row; `graphs_mxfp4` /
`static_mxfp4` compute the experts from their MXFP4 copy (mxfp4_decode.py, train_grpo's DECODE_EXPERTS=mxfp4); a
`_merged` suffix decodes with the LoRA adapter merged into bf16 copies of the attention weights (the earlier
decode path) instead of adding its output in PEFT's order. graph_decode variants run the decode step's glue (norms,
residual adds, rotary embedding, sinks, LoRA adds: decode_glue.py) compiled on CUDA, as train_grpo's default
DECODE_GLUE=auto does; an `_eagerglue` suffix runs it kernel by kernel (DECODE_GLUE=eager), to time the two in one
run (`--VARIANTS=graphs_mxfp4,graphs_mxfp4_eagerglue`). graph_decode variants attend with decode_attention.py's
kernel on CUDA; a `_flexattn` suffix with flex attention's decoding kernel, which decoded before, to time the two in
one run; and compute the attention projections with decode_linear.py's kernel on CUDA, a `_cublasproj` suffix with
cuBLAS's products, which computed them before; and draw each token with draw_kernel.py's kernels on CUDA, a
`_torchdraw` suffix with torch's softmax and multinomial, which drew before. graph_decode variants run under
AUTOCAST, as train_grpo's generate runs them (the trainer's autocast).

NUM_PROMPTS > 0 makes the batch GRPO-shaped, as TRL passes it to generate(): NUM_PROMPTS distinct prompts, each
repeated NUM_SEQS / NUM_PROMPTS times in a row, real lengths up to PROMPT_LEN_SPREAD tokens shorter than PROMPT_LEN
and left-padded. The table printed last has, per variant, the prefill (a generate call of one new token) and the
whole call, and the decode step (the call less the prefill, over NEW_TOKENS - 1 steps) as a share of the decode limit
(decode_limit.py: the bytes a step must move at NUM_SEQS sequences and the mean cache length, prompt + NEW_TOKENS / 2,
over the copy rate measured on this GPU at the start; the experts as the variant reads them). LORA_R > 0 decodes
through train_grpo's LoRA adapter in train mode, the state GRPO generates in;
LORA_RHO > 0 draws its B so that each projection's delta is that fraction of its weight in rms (a run at LR 5e-5
passes through 1e-4 to 1e-2).
RECOMPILE_LENGTHS > 0 then prefills that many different prompt lengths (PROMPT_LEN down to PROMPT_LEN - 300) through
graph_decode and prints how many graphs torch.compile built for them (flex attention; TORCH_LOGS=recompiles is on
for that part, so each recompile prints its reason). COMPARE_SEQS > 0 measures how closely each sampler samples the
policy being trained: it samples completions with transformers' generate (left-padded prompts, as TRL pads them) and
prints, for transformers' own log-probabilities and graph_decode's (PEFT order and merged; bf16 and MXFP4 experts)
of those tokens, the mean and max |log p difference| and the gen-KL estimate (sampling_fidelity.py's metrics)
against the trainer's: TRL's training forward under the trainer's autocast, with its fused LM head
(decode_compare.trainer_logprobs); and, as before, against one plain forward over them.
"""

from __future__ import annotations

import sys as _sys
from pathlib import Path as _Path

# Run as `python benchmarks/<name>.py` from the repo root: Python puts benchmarks/ on sys.path, not the root
# that holds train_grpo.py and the tes_grpo package.
_sys.path.insert(0, str(_Path(__file__).resolve().parents[1]))

import contextlib
import sys
import time

from tes_grpo.model.gpt_oss_shapes import build_random_model
from tes_grpo.run.script_config import resolve

NUM_SEQS = 64  # sequences decoded together
NUM_PROMPTS = 0  # distinct prompts among them, each repeated NUM_SEQS/NUM_PROMPTS times in a row (TRL); 0 = all
PROMPT_LEN = 1316  # prompt tokens per sequence, padding included (the TES prompts are about this long)
PROMPT_LEN_SPREAD = 0  # distinct prompts are up to this many tokens shorter, left-padded to PROMPT_LEN (as TRL pads)
NEW_TOKENS = 128  # tokens generated per sequence (random weights never stop early)
ATTN = "flex_attention"  # attention kernel: flex_attention (has sinks) | eager | sdpa
VARIANTS = ("default", "grouped_mm")  # default|grouped_mm|grouped_mm_graphs|static|graphs|*_unshared, comma-separated
PREFILL_BUCKET = 256  # graph_decode variants: prompts left-padded to a multiple of this before prefill; 0 = none
LORA_R = 0  # >0: generate through train_grpo's LoRA adapter of this rank (fp32 weights), in train mode as GRPO does
LORA_B_STD = 0.0  # >0: LoRA's B weights drawn from N(0, this) instead of PEFT's zeros, so the adapter changes outputs
LORA_RHO = 0.0  # >0: instead, B drawn and scaled so rms(LoRA delta) / rms(W) = this for every projection
AUTOCAST = "bf16"  # the trainer's autocast, which graph_decode decodes under (train_grpo on a GPU: bf16); none = off
REPEATS = 1  # timed generate calls per variant (after one warm-up call)
SEED = 0  # torch seed for weights and prompts
PROFILE_TOKENS = 0  # >0: after timing, profile a generate call of this many new tokens per variant (torch.profiler)
COMPARE_SEQS = 0  # >0: compare graph_decode's log-probabilities with transformers' on this many sampled sequences
COMPARE_TOKENS = 64  # completion tokens per sequence in that comparison
RECOMPILE_LENGTHS = 0  # >0: prefill this many prompt lengths through graph_decode and count torch.compile's graphs


def variant_generate_kwargs(variant: str) -> dict:
    """Extra generate() arguments of a variant.

    grouped_mm_graphs: a static KV cache, which makes transformers compile the forward (torch.compile,
    mode "reduce-overhead" = CUDA graphs) so a decode step replays one graph instead of ~2,400 kernel launches.
    """
    if variant != "grouped_mm_graphs":
        return {}
    from transformers import CompileConfig

    return {"cache_implementation": "static", "compile_config": CompileConfig(mode="reduce-overhead", dynamic=False)}


_TRANSFORMERS_VARIANTS = ("default", "grouped_mm", "grouped_mm_graphs")
# static|graphs followed by any of these, joined by _
_GRAPH_DECODE_FLAGS = ("unshared", "mxfp4", "merged", "eagerglue", "flexattn", "cublasproj", "torchdraw")


def variant_flags(variant: str) -> set[str] | None:
    """The flags of a graph_decode variant (static|graphs followed by _unshared, _mxfp4, _merged, _eagerglue,
    _flexattn, _cublasproj, _torchdraw in any order), or None for a variant that is not graph_decode's."""
    base, *flags = variant.split("_")
    if base not in ("static", "graphs") or not set(flags) <= set(_GRAPH_DECODE_FLAGS) or len(set(flags)) < len(flags):
        return None
    return set(flags)


def variant_experts(variant: str) -> str:
    """How a variant's decode steps read the experts (decode_limit.decode_bytes' format): graph_decode's _mxfp4
    variants from the MXFP4 copy, every other variant the model's bf16 experts."""
    return "mxfp4" if "mxfp4" in (variant_flags(variant) or ()) else "bf16"


def is_graph_decode(variant: str) -> bool:
    return variant_flags(variant) is not None


def autocast_dtype(name: str):
    """AUTOCAST's dtype: bf16 -> torch.bfloat16, none -> None."""
    import torch

    return {"bf16": torch.bfloat16, "none": None}[name]


def token_ids(model) -> tuple[int, int]:
    """(ids drawn below this, pad id): gpt-oss's ordinary tokens and its pad, <|endoftext|> (TRL pads with it)."""
    config = model.config
    return min(199998, config.vocab_size), config.pad_token_id


def grpo_prompts(num_seqs: int, num_prompts: int, prompt_len: int, spread: int, model, seed: int):
    """input_ids and attention_mask [num_seqs, prompt_len] on the model's device as TRL passes a GRPO batch to
    generate(): num_prompts distinct prompts (0 = every row its own), each repeated in a row, shorter ones
    left-padded."""
    import torch

    vocab, pad_id = token_ids(model)
    distinct = num_prompts or num_seqs
    generator = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, vocab, (distinct, prompt_len), generator=generator)
    mask = torch.ones_like(ids)
    if spread:
        pads = torch.randint(0, spread + 1, (distinct,), generator=generator)
        pads[0] = 0  # the longest prompt sets the padded length, as in TRL
        for row, pad in enumerate(pads.tolist()):
            mask[row, :pad] = 0
    ids = ids.masked_fill(mask == 0, pad_id)
    rows = torch.arange(distinct).repeat_interleave(num_seqs // distinct)
    return ids[rows].to(model.device), mask[rows].to(model.device)


def run_generate(model, input_ids, attention_mask, new_tokens: int, variant: str, prefill_bucket: int,
                 autocast=None, **extra):
    """One generation of exactly new_tokens per sequence (random weights: no end token is waited for); graph_decode
    variants decode under `autocast` (the trainer's)."""
    from transformers import GenerationConfig

    flags = variant_flags(variant)
    if flags is not None:
        from tes_grpo.sampling import graph_decode
        config = GenerationConfig(max_new_tokens=new_tokens, do_sample=True, temperature=1.0, top_p=1.0,
                                  pad_token_id=token_ids(model)[1], eos_token_id=None)
        return graph_decode.generate(model, input_ids, attention_mask, config, graphs=variant.startswith("graphs"),
                                     share_prompts="unshared" not in flags, prefill_bucket=prefill_bucket,
                                     experts="mxfp4" if "mxfp4" in flags else "model",
                                     lora="merged" if "merged" in flags else "peft", autocast=autocast,
                                     glue="eager" if "eagerglue" in flags else "compiled",
                                     attention_kernel="flex" if "flexattn" in flags else "triton",
                                     projection_kernel="cublas" if "cublasproj" in flags else "triton",
                                     draw_kernel="torch" if "torchdraw" in flags else "triton")
    return model.generate(input_ids=input_ids, attention_mask=attention_mask, max_new_tokens=new_tokens,
                          min_new_tokens=new_tokens, do_sample=True, temperature=1.0, top_p=1.0, use_cache=True,
                          pad_token_id=token_ids(model)[1], **extra)


def time_generate(model, input_ids, attention_mask, new_tokens: int, variant: str, prefill_bucket: int,
                  autocast=None, **extra) -> tuple[float, float]:
    """Seconds for one generation and the peak GiB it reached."""
    import torch

    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    start = time.perf_counter()
    out = run_generate(model, input_ids, attention_mask, new_tokens, variant, prefill_bucket, autocast, **extra)
    torch.cuda.synchronize()
    assert out.shape[1] == input_ids.shape[1] + new_tokens
    return time.perf_counter() - start, torch.cuda.max_memory_allocated() / 2**30


def profile_generate(model, input_ids, attention_mask, new_tokens: int, label: str, prefill_bucket: int,
                     autocast=None, **extra) -> None:
    """Prints where a short generate call spends its time: GPU busy time against wall time, and the top kernels.

    GPU-busy well below wall time means the decode loop is bound by the CPU (Python, kernel launches, syncs).
    """
    import torch
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        torch.cuda.synchronize()
        start = time.perf_counter()
        run_generate(model, input_ids, attention_mask, new_tokens, label, prefill_bucket, autocast, **extra)
        torch.cuda.synchronize()
        wall = time.perf_counter() - start
    events = prof.key_averages()
    # kernels appear both on their own rows (no CPU time) and inside the aten op that launched them: count them once
    gpu_us = sum(e.self_device_time_total for e in events if e.self_cpu_time_total == 0)
    launches = sum(e.count for e in events if e.key.startswith(("cudaLaunchKernel", "cuLaunchKernel")))
    syncs = sum(e.count for e in events if "Synchronize" in e.key or e.key == "aten::item"
                or e.key == "aten::_local_scalar_dense")
    print(f"\nprofile {label}: {new_tokens} new tokens, wall {wall:.2f} s, GPU busy {gpu_us / 1e6:.2f} s "
          f"({100 * gpu_us / 1e6 / wall:.0f}%), {launches} kernel launches, {syncs} host syncs/item() calls")
    print(events.table(sort_by="self_device_time_total", row_limit=15, max_name_column_width=60))
    print(events.table(sort_by="self_cpu_time_total", row_limit=12, max_name_column_width=60))


def gap_row(name: str, values, reference) -> str:
    """One comparison line: mean and max |log p difference| and the gen-KL estimate (mean of e^d - d - 1, d =
    reference - values: sampling_fidelity's gen_kl_error when the reference is the trainer's)."""
    d = (reference - values).double()
    kl = (d.exp() - d - 1).mean()
    return f"  {name:<30} mean |diff| {d.abs().mean():.2e}  max |diff| {d.abs().max():.2e}  gen KL {kl:.2e}"


def compare_logprobs(model, seqs: int, tokens: int, prompt_len: int, autocast=None) -> list[str]:
    """Lines saying how far each sampler's log-probabilities of the same sampled tokens are from the trainer's (and from
    one plain forward): transformers' generate (which sampled them), graph_decode with the adapter in PEFT's order
    and merged, with the model's experts and (on CUDA) the MXFP4 copy, and on CUDA also the MXFP4 copy in PEFT's
    order with the glue compiled (DECODE_GLUE=compiled); graph_decode under `autocast`."""
    import torch

    from benchmarks.decode_compare import (
        decode_logprobs,
        full_forward_logprobs,
        trainer_logprobs,
        transformers_logprobs,
    )

    vocab, pad_id = token_ids(model)
    graphs = model.device.type == "cuda"
    with torch.no_grad():
        ids = torch.randint(0, vocab, (seqs, prompt_len), device=model.device)
        mask = torch.ones_like(ids)
        for row in range(1, seqs, 2):
            mask[row, :row * 37 % 300 + 1] = 0  # TRL left-pads shorter prompts
        ids = ids.masked_fill(mask == 0, pad_id)
        completion, theirs = transformers_logprobs(model, ids, mask, tokens, pad_id)
        samplers = {"transformers generate": theirs}
        for experts in ("model", "mxfp4") if graphs else ("model",):
            for lora in ("peft", "merged"):
                samplers[f"graph_decode {experts} {lora}"] = decode_logprobs(
                    model, ids, mask, completion, graphs=graphs, experts=experts, lora=lora, autocast=autocast)
        if graphs:  # the compiled glue's own gap: what DECODE_GLUE=compiled must match eager's on
            samplers["graph_decode mxfp4 peft, glue compiled"] = decode_logprobs(
                model, ids, mask, completion, graphs=True, experts="mxfp4", autocast=autocast, glue="compiled")
        trainer = trainer_logprobs(model, ids, mask, completion, autocast=autocast)
        plain = full_forward_logprobs(model, ids, mask, completion)
    lines = [f"log-probabilities of {seqs} x {tokens} sampled tokens (mean |log p| {trainer.abs().mean():.3f}) against "
             f"the trainer's (TRL's training forward, autocast {autocast}):"]
    lines += [gap_row(name, values, trainer) for name, values in samplers.items()]
    lines.append("against one plain forward over them (positions as generate() sets them, no autocast):")
    lines += [gap_row(name, values, plain) for name, values in samplers.items()]
    return lines


def count_prefill_compiles(model, settings) -> list[tuple]:
    """Prefills RECOMPILE_LENGTHS GRPO-shaped batches of different prompt lengths through graph_decode; returns
    (what, value) rows: the prefill shapes the model saw, the graphs torch.compile built, the seconds."""
    import torch
    from torch._dynamo.utils import counters

    from benchmarks.decode_compare import prefill_shapes
    from tes_grpo.layers.lora import causal_lm
    from tes_grpo.sampling import decode_cache

    torch._logging.set_logs(recompiles=True)
    span = min(300, settings.PROMPT_LEN // 2)
    lengths = [settings.PROMPT_LEN - span * i // max(1, settings.RECOMPILE_LENGTHS - 1)
               for i in range(settings.RECOMPILE_LENGTHS)]
    before = counters["stats"]["unique_graphs"]
    start = time.perf_counter()
    try:
        with prefill_shapes(model) as shapes:
            for i, length in enumerate(lengths):
                ids, mask = grpo_prompts(settings.NUM_SEQS, settings.NUM_PROMPTS, length, settings.PROMPT_LEN_SPREAD,
                                         model, settings.SEED + 1 + i)
                with torch.no_grad():
                    decode_cache.prefill(causal_lm(model), ids, mask, 1, token_ids(model)[1],
                                         bucket=settings.PREFILL_BUCKET, autocast=autocast_dtype(settings.AUTOCAST))
            torch.cuda.synchronize()
    finally:
        torch._logging.set_logs(recompiles=False)
    return [("prompt lengths", f"{len(lengths)} ({min(lengths)}-{max(lengths)})"),
            ("prefill shapes (rows x length)", ", ".join(f"{r}x{n}" for r, n in sorted(set(shapes)))),
            ("graphs torch.compile built", counters["stats"]["unique_graphs"] - before),
            ("seconds", f"{time.perf_counter() - start:.1f}")]


def grpo_state(model, rank: int, b_std: float = 0.0, rho: float = 0.0):
    """The model as GRPO generates with it: train_grpo's LoRA adapter (PEFT casts it to fp32), train mode, PEFT's
    input-require-grads hook (TRL adds it with gradient checkpointing, which it switches off around generate).
    b_std or rho > 0: B drawn (decode_compare.draw_lora_b)."""
    from peft import get_peft_model

    import train_grpo
    from benchmarks.decode_compare import draw_lora_b

    peft_model = get_peft_model(model, train_grpo.build_lora_config(rank, 2 * rank))
    if b_std or rho:
        draw_lora_b(peft_model, rho, b_std)
    peft_model.train()
    peft_model.enable_input_require_grads()
    return peft_model


def main(argv: list[str] | None = None) -> int:
    from tes_grpo.layers.lora import causal_lm
    from tes_grpo.patches.transformers_patches import grouped_mm_experts_for_decode

    settings = resolve(globals(), argv)
    unknown = [v for v in settings.VARIANTS if v not in _TRANSFORMERS_VARIANTS and not is_graph_decode(v)]
    if unknown:
        print(f"error: VARIANTS: unknown {', '.join(unknown)} (known: {', '.join(_TRANSFORMERS_VARIANTS)}, and static "
              f"or graphs followed by any of _{', _'.join(_GRAPH_DECODE_FLAGS)})", file=sys.stderr)
        return 2
    if settings.AUTOCAST not in ("bf16", "none"):
        print(f"error: AUTOCAST={settings.AUTOCAST!r}: bf16 or none", file=sys.stderr)
        return 2
    if settings.NUM_PROMPTS and settings.NUM_SEQS % settings.NUM_PROMPTS:
        print(f"error: NUM_SEQS={settings.NUM_SEQS} is not a multiple of NUM_PROMPTS={settings.NUM_PROMPTS}",
              file=sys.stderr)
        return 2
    import torch

    from benchmarks.decode_limit import DecodeLimit, measure_copy_rate
    from benchmarks.log_header import header

    torch.manual_seed(settings.SEED)
    # before the model, while the copy's 2 GiB are free; without a CUDA device (the CPU test) there is no rate
    copy_rate = measure_copy_rate() if torch.cuda.is_available() else None
    print(header(copy_rate=copy_rate), flush=True)
    if not copy_rate:
        print("copy rate: none (no CUDA device): no decode limit")
    model = build_random_model(attn_implementation=settings.ATTN).requires_grad_(False)  # nothing trains here
    config = model.config
    if settings.LORA_R:
        model = grpo_state(model, settings.LORA_R, settings.LORA_B_STD, settings.LORA_RHO)
    autocast = autocast_dtype(settings.AUTOCAST)
    input_ids, attention_mask = grpo_prompts(settings.NUM_SEQS, settings.NUM_PROMPTS, settings.PROMPT_LEN,
                                             settings.PROMPT_LEN_SPREAD, model, settings.SEED)
    bucket = settings.PREFILL_BUCKET
    rows = []
    for variant in settings.VARIANTS:
        keep = variant != "default"
        ctx = grouped_mm_experts_for_decode(causal_lm(model), say=print) if keep else contextlib.nullcontext()
        extra = variant_generate_kwargs(variant)
        with ctx:
            # warm-up: kernels and flex attention compilation at the real shapes; a static cache is sized by the
            # whole generation, so the graphs variant warms up at the full length
            warm_seconds, _ = time_generate(model, input_ids, attention_mask, settings.NEW_TOKENS if extra else 2,
                                            variant, bucket, autocast, **extra)
            print(f"{variant}: warm-up {warm_seconds:.1f} s", flush=True)
            # the prefill alone: a call of one new token (no decode step); not for a static cache sized by the call
            prefill = None if extra else time_generate(model, input_ids, attention_mask, 1, variant, bucket,
                                                       autocast)[0]
            for _ in range(settings.REPEATS):
                seconds, peak = time_generate(model, input_ids, attention_mask, settings.NEW_TOKENS, variant, bucket,
                                              autocast, **extra)
                rows.append((variant, prefill, seconds, settings.NUM_SEQS * settings.NEW_TOKENS / seconds, peak))
                print(f"{variant}: {seconds:.1f} s, {rows[-1][3]:.0f} tok/s, peak {peak:.1f} GiB", flush=True)
            if settings.PROFILE_TOKENS:
                profile_generate(model, input_ids, attention_mask, settings.PROFILE_TOKENS, variant, bucket, autocast,
                                 **extra)
    compiles = count_prefill_compiles(model, settings) if settings.RECOMPILE_LENGTHS else []
    gaps = []
    if settings.COMPARE_SEQS:
        with grouped_mm_experts_for_decode(causal_lm(model), say=print):
            gaps = compare_logprobs(model, settings.COMPARE_SEQS, settings.COMPARE_TOKENS, settings.PROMPT_LEN,
                                    autocast)
    # the decode limit at the run's mean cache length: the real prompt tokens, then half the new ones on average
    mean_cache = float(attention_mask.sum(dim=1).float().mean()) + settings.NEW_TOKENS / 2
    limits = {}
    for variant, *_ in rows:
        fmt = variant_experts(variant)
        if fmt not in limits:
            limits[fmt] = DecodeLimit(config, fmt, settings.LORA_R, copy_rate).bytes(settings.NUM_SEQS, mean_cache)
            print("\n".join(limits[fmt].lines(copy_rate)))
    distinct = settings.NUM_PROMPTS or settings.NUM_SEQS
    scale = f"rho {settings.LORA_RHO}" if settings.LORA_RHO else f"B std {settings.LORA_B_STD}"
    lora = f", LoRA r={settings.LORA_R} in train mode, {scale}" if settings.LORA_R else ""
    print(f"\n{settings.NUM_SEQS} sequences = {distinct} distinct prompts x {settings.NUM_SEQS // distinct}, "
          f"{settings.PROMPT_LEN} prompt tokens (real: {settings.PROMPT_LEN_SPREAD} fewer at most), "
          f"{settings.NEW_TOKENS} new, prefill bucket {bucket}, autocast {settings.AUTOCAST}{lora}")
    print(f"{'variant':<22}{'prefill s':>10}{'seconds':>10}{'tok/s':>10}{'ms/step':>10}{'limit ms':>10}{'of limit':>10}"
          f"{'peak GiB':>10}")
    for variant, prefill, seconds, tps, peak in rows:
        step_ms = 1000 * (seconds - (prefill or 0.0)) / max(1, settings.NEW_TOKENS - 1)
        step_ms = step_ms if prefill is not None else float("nan")
        limit_ms = 1e3 * limits[variant_experts(variant)].seconds(copy_rate) if copy_rate else float("nan")
        print(f"{variant:<22}{'-' if prefill is None else f'{prefill:.2f}':>10}{seconds:>10.1f}{tps:>10.0f}"
              f"{step_ms:>10.1f}{limit_ms:>10.2f}{100 * limit_ms / step_ms:>9.1f}%{peak:>10.1f}")
    for what, value in compiles:
        print(f"{what}: {value}")
    for line in gaps:
        print(line)
    return 0


if __name__ == "__main__":
    sys.exit(main())
