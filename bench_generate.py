"""Generation throughput of a gpt-oss-20b-shaped model (random weights) on one GPU, per experts path.

Run on the GPU machine (the numbers go to BENCHMARKS.md):

    python bench_generate.py --NUM_SEQS=64 --NEW_TOKENS=128

It builds the 20B architecture in bf16 straight on the GPU (no download), then times `model.generate`
(prefill included) for each experts implementation in VARIANTS. `default` is transformers' own choice,
which switches `grouped_mm` experts to `batched_mm` while decoding; `grouped_mm` keeps grouped GEMM
throughout (see `gpt_oss_shapes.keep_experts_implementation_for_decode`).
"""

from __future__ import annotations

import contextlib
import time

import torch

from gpt_oss_shapes import build_random_model, keep_experts_implementation_for_decode, stack_versions
from script_config import configure

NUM_SEQS = 64  # sequences decoded together
PROMPT_LEN = 1316  # prompt tokens per sequence (the TES prompts are about this long)
NEW_TOKENS = 128  # tokens generated per sequence (random weights never stop early)
ATTN = "flex_attention"  # attention kernel: flex_attention (has sinks) | eager | sdpa
VARIANTS = ("default", "grouped_mm")  # default | grouped_mm | grouped_mm_graphs, comma-separated on the command line
REPEATS = 1  # timed generate calls per variant (after one warm-up call)
SEED = 0  # torch seed for weights and prompts
PROFILE_TOKENS = 0  # >0: after timing, profile a generate call of this many new tokens per variant (torch.profiler)


def variant_generate_kwargs(variant: str) -> dict:
    """Extra generate() arguments of a variant.

    grouped_mm_graphs: a static KV cache, which makes transformers compile the forward (torch.compile,
    mode "reduce-overhead" = CUDA graphs) so a decode step replays one graph instead of ~2,400 kernel launches.
    """
    if variant != "grouped_mm_graphs":
        return {}
    from transformers import CompileConfig

    return {"cache_implementation": "static", "compile_config": CompileConfig(mode="reduce-overhead", dynamic=False)}


def time_generate(model, input_ids, new_tokens: int, **extra) -> tuple[float, float]:
    """Seconds for one generate call and the peak GiB it reached."""
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    start = time.perf_counter()
    out = model.generate(input_ids=input_ids, attention_mask=torch.ones_like(input_ids), max_new_tokens=new_tokens,
                         min_new_tokens=new_tokens, do_sample=True, temperature=1.0, top_p=1.0, use_cache=True,
                         pad_token_id=199999, **extra)
    torch.cuda.synchronize()
    assert out.shape[1] == input_ids.shape[1] + new_tokens
    return time.perf_counter() - start, torch.cuda.max_memory_allocated() / 2**30


def profile_generate(model, input_ids, new_tokens: int, label: str) -> None:
    """Prints where a short generate call spends its time: GPU busy time against wall time, and the top kernels.

    GPU-busy well below wall time means the decode loop is bound by the CPU (Python, kernel launches, syncs).
    """
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        torch.cuda.synchronize()
        start = time.perf_counter()
        model.generate(input_ids=input_ids, attention_mask=torch.ones_like(input_ids), max_new_tokens=new_tokens,
                       min_new_tokens=new_tokens, do_sample=True, use_cache=True, pad_token_id=199999)
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


def main(argv: list[str] | None = None) -> None:
    configure(globals(), argv)
    torch.manual_seed(SEED)
    print(stack_versions())
    model = build_random_model(attn_implementation=ATTN)
    input_ids = torch.randint(0, 199998, (NUM_SEQS, PROMPT_LEN), device="cuda")
    rows = []
    for variant in VARIANTS:
        keep = variant.startswith("grouped_mm")
        ctx = keep_experts_implementation_for_decode(model) if keep else contextlib.nullcontext()
        extra = variant_generate_kwargs(variant)
        with ctx:
            # warm-up: kernels and flex attention compilation at the real shapes; a static cache is sized by the
            # whole generation, so the graphs variant warms up at the full length
            warm_seconds, _ = time_generate(model, input_ids, NEW_TOKENS if extra else 2, **extra)
            print(f"{variant}: warm-up {warm_seconds:.1f} s", flush=True)
            for _ in range(REPEATS):
                seconds, peak = time_generate(model, input_ids, NEW_TOKENS, **extra)
                rows.append((variant, NUM_SEQS, PROMPT_LEN, NEW_TOKENS, seconds, NUM_SEQS * NEW_TOKENS / seconds, peak))
                print(f"{variant}: {seconds:.1f} s, {rows[-1][5]:.0f} tok/s, peak {peak:.1f} GiB", flush=True)
            if PROFILE_TOKENS:
                profile_generate(model, input_ids, PROFILE_TOKENS, variant)
    print(f"\n{'experts':<18}{'seqs':>6}{'prompt':>8}{'new':>6}{'seconds':>10}{'tok/s':>10}{'peak GiB':>10}")
    for variant, seqs, plen, new, seconds, tps, peak in rows:
        print(f"{variant:<18}{seqs:>6}{plen:>8}{new:>6}{seconds:>10.1f}{tps:>10.0f}{peak:>10.1f}")


if __name__ == "__main__":
    main()
