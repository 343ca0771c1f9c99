"""Generation throughput of a gpt-oss-20b-shaped model (random weights) on one GPU, per experts path.

Run on the GPU machine (the numbers go to BENCHMARKS.md):

    python benchmarks/bench_generate.py --NUM_SEQS=64 --NEW_TOKENS=128
    python benchmarks/bench_generate.py --NUM_SEQS=64 --NEW_TOKENS=128 --VARIANTS=grouped_mm,static,graphs --COMPARE_SEQS=8

It builds the 20B architecture in bf16 straight on the GPU (no download), then times generation (prefill
included) for each variant in VARIANTS. `default` is transformers' generate as shipped, which switches `grouped_mm`
experts to `batched_mm` while decoding; `grouped_mm` keeps grouped GEMM throughout (see
`gpt_oss_shapes.keep_experts_implementation_for_decode`); `static` is graph_decode.py's decode loop without CUDA
graphs and `graphs` the same with each decode step replayed as a CUDA graph (train_grpo's DECODE_GRAPHS).
COMPARE_SEQS > 0 then checks that graph_decode gives transformers' distribution: it samples completions with
transformers' generate (left-padded prompts, as TRL pads them) and prints how far the log-probabilities that
transformers' decoding and graph_decode's give those tokens are from one full forward pass over them.
"""

from __future__ import annotations

import sys as _sys
from pathlib import Path as _Path

# Run as `python benchmarks/<name>.py` from the repo root: Python puts benchmarks/ on sys.path, not the root
# that holds train_grpo.py and the tes_grpo package.
_sys.path.insert(0, str(_Path(__file__).resolve().parents[1]))

import contextlib
import time

import torch

from transformers import GenerationConfig

from tes_grpo.gpt_oss_shapes import build_random_model, keep_experts_implementation_for_decode, stack_versions
from tes_grpo.script_config import configure

NUM_SEQS = 64  # sequences decoded together
PROMPT_LEN = 1316  # prompt tokens per sequence (the TES prompts are about this long)
NEW_TOKENS = 128  # tokens generated per sequence (random weights never stop early)
ATTN = "flex_attention"  # attention kernel: flex_attention (has sinks) | eager | sdpa
VARIANTS = ("default", "grouped_mm")  # default | grouped_mm | grouped_mm_graphs | static | graphs, comma-separated
REPEATS = 1  # timed generate calls per variant (after one warm-up call)
SEED = 0  # torch seed for weights and prompts
PROFILE_TOKENS = 0  # >0: after timing, profile a generate call of this many new tokens per variant (torch.profiler)
COMPARE_SEQS = 0  # >0: compare graph_decode's log-probabilities with transformers' on this many sampled sequences
COMPARE_TOKENS = 64  # completion tokens per sequence in that comparison


def variant_generate_kwargs(variant: str) -> dict:
    """Extra generate() arguments of a variant.

    grouped_mm_graphs: a static KV cache, which makes transformers compile the forward (torch.compile,
    mode "reduce-overhead" = CUDA graphs) so a decode step replays one graph instead of ~2,400 kernel launches.
    """
    if variant != "grouped_mm_graphs":
        return {}
    from transformers import CompileConfig

    return {"cache_implementation": "static", "compile_config": CompileConfig(mode="reduce-overhead", dynamic=False)}


def run_generate(model, input_ids, new_tokens: int, variant: str, **extra):
    """One generation of exactly new_tokens per sequence (random weights: no end token is waited for)."""
    if variant in ("static", "graphs"):
        from tes_grpo import graph_decode
        config = GenerationConfig(max_new_tokens=new_tokens, do_sample=True, temperature=1.0, top_p=1.0,
                                  pad_token_id=199999, eos_token_id=None)
        return graph_decode.generate(model, input_ids, torch.ones_like(input_ids), config, graphs=variant == "graphs")
    return model.generate(input_ids=input_ids, attention_mask=torch.ones_like(input_ids), max_new_tokens=new_tokens,
                          min_new_tokens=new_tokens, do_sample=True, temperature=1.0, top_p=1.0, use_cache=True,
                          pad_token_id=199999, **extra)


def time_generate(model, input_ids, new_tokens: int, variant: str = "grouped_mm", **extra) -> tuple[float, float]:
    """Seconds for one generation and the peak GiB it reached."""
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    start = time.perf_counter()
    out = run_generate(model, input_ids, new_tokens, variant, **extra)
    torch.cuda.synchronize()
    assert out.shape[1] == input_ids.shape[1] + new_tokens
    return time.perf_counter() - start, torch.cuda.max_memory_allocated() / 2**30


def profile_generate(model, input_ids, new_tokens: int, label: str, **extra) -> None:
    """Prints where a short generate call spends its time: GPU busy time against wall time, and the top kernels.

    GPU-busy well below wall time means the decode loop is bound by the CPU (Python, kernel launches, syncs).
    """
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        torch.cuda.synchronize()
        start = time.perf_counter()
        run_generate(model, input_ids, new_tokens, label, **extra)
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


@torch.no_grad()
def compare_logprobs(model, seqs: int, tokens: int) -> None:
    """Prints |log p| differences of transformers' decoding and graph_decode's (graphs on) against a full forward, on
    the same sampled completions of left-padded prompts."""
    from tes_grpo import graph_decode
    ids = torch.randint(0, 199998, (seqs, PROMPT_LEN), device=model.device)
    mask = torch.ones_like(ids)
    for row in range(1, seqs, 2):
        mask[row, :row * 37 % 300 + 1] = 0  # TRL left-pads shorter prompts
    ids = ids.masked_fill(mask == 0, 199999)
    out = model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=tokens, min_new_tokens=tokens,
                         do_sample=True, use_cache=True, pad_token_id=199999, output_logits=True,
                         return_dict_in_generate=True)
    completion = out.sequences[:, ids.shape[1]:]
    transformers_lp = torch.log_softmax(torch.stack(out.logits, dim=1).float(), dim=-1) \
        .gather(2, completion[..., None]).squeeze(2)
    ours = graph_decode.completion_logprobs(model, ids, mask, completion, graphs=model.device.type == "cuda")
    reference = graph_decode.full_forward_logprobs(model, ids, mask, completion)
    print(f"\nlog-probabilities of {seqs} x {tokens} sampled tokens against one full forward over them "
          f"(mean |log p| {reference.abs().mean():.3f}):")
    for name, values in (("transformers generate", transformers_lp), ("graph_decode graphs", ours)):
        diff = (values - reference).abs()
        print(f"  {name:<22} mean |diff| {diff.mean():.5f}  max |diff| {diff.max():.5f}")


def main(argv: list[str] | None = None) -> None:
    configure(globals(), argv)
    torch.manual_seed(SEED)
    print(stack_versions())
    model = build_random_model(attn_implementation=ATTN)
    input_ids = torch.randint(0, 199998, (NUM_SEQS, PROMPT_LEN), device="cuda")
    rows = []
    for variant in VARIANTS:
        keep = variant != "default"
        ctx = keep_experts_implementation_for_decode(model) if keep else contextlib.nullcontext()
        extra = variant_generate_kwargs(variant)
        with ctx:
            # warm-up: kernels and flex attention compilation at the real shapes; a static cache is sized by the
            # whole generation, so the graphs variant warms up at the full length
            warm_seconds, _ = time_generate(model, input_ids, NEW_TOKENS if extra else 2, variant, **extra)
            print(f"{variant}: warm-up {warm_seconds:.1f} s", flush=True)
            for _ in range(REPEATS):
                seconds, peak = time_generate(model, input_ids, NEW_TOKENS, variant, **extra)
                rows.append((variant, NUM_SEQS, PROMPT_LEN, NEW_TOKENS, seconds, NUM_SEQS * NEW_TOKENS / seconds, peak))
                print(f"{variant}: {seconds:.1f} s, {rows[-1][5]:.0f} tok/s, peak {peak:.1f} GiB", flush=True)
            if PROFILE_TOKENS:
                profile_generate(model, input_ids, PROFILE_TOKENS, variant, **extra)
    if COMPARE_SEQS:
        with keep_experts_implementation_for_decode(model):
            compare_logprobs(model, COMPARE_SEQS, COMPARE_TOKENS)
    print(f"\n{'experts':<18}{'seqs':>6}{'prompt':>8}{'new':>6}{'seconds':>10}{'tok/s':>10}{'peak GiB':>10}")
    for variant, seqs, plen, new, seconds, tps, peak in rows:
        print(f"{variant:<18}{seqs:>6}{plen:>8}{new:>6}{seconds:>10.1f}{tps:>10.0f}{peak:>10.1f}")


if __name__ == "__main__":
    main()
