"""One GRPO training micro-batch (forward + backward) through the first LAYERS layers of a gpt-oss-20b-shaped model,
set up as train_grpo trains it (LoRA r4 on the attention, gradient checkpointing, bf16 autocast), per variant
(TRAIN_EXPERTS, flex masks from padding bounds, TRAIN_GLUE): timed, profiled by kernel, and (ATTENTION_PROBE) flex
attention's own calls timed outside the model. Run on the GPU machine (the numbers go to BENCHMARKS.md):

    python benchmarks/bench_train_pass.py
    python benchmarks/bench_train_pass.py --LAYERS=2 --VARIANTS=fused --PROFILE=0
    python benchmarks/bench_train_pass.py --LAYERS=4 --ROWS=8 --LENGTH=4869 --ATTENTION_PROBE=0 \
        --VARIANTS=fused+bounds,fused+bounds+glue   # the 4,000-token micro-batch, without and with the training glue

Why: bench_grpo.py --PROFILE_TRAIN=1 put a 1,024-token micro-batch (16 x 2,335 tokens) at 5.07 s of GPU time, ~45 %
of it elementwise kernels (mostly the MoE's, fused_experts.py) and 24 % flex attention's forward at 25 ms a call,
which bench_flex_attention.py measured at 4.7 / 2.3 ms for the same shape outside the model. A few layers give the
per-layer cost in about a minute instead of a whole GRPO step; the model's 24 layers cost ~24/LAYERS times as much
(plus the LM head, which TRL fuses).
"""

from __future__ import annotations

import sys as _sys
from pathlib import Path as _Path

_sys.path.insert(0, str(_Path(__file__).resolve().parents[1]))

import sys
import time

from benchmarks.timing import timed_ms  # warms up once, then times reps calls by CUDA events
from tes_grpo.run.script_config import resolve

LAYERS = 4  # decoder layers built (alternating sliding / full attention, as gpt-oss-20b's 24)
ROWS = 16  # sequences in the micro-batch (TRAIN_BATCH_SIZE=auto picks 16 at 1,024-token completions)
LENGTH = 2335  # tokens per sequence (1,311-token prompt + 1,024 completion)
LEFT_PAD = 40  # every other row's prompt is this many tokens shorter (left padding, masked)
# what to time: TRAIN_EXPERTS (transformers | fused), "+bounds" = flex masks from padding bounds
# (patches/transformers_patches.py), "+glue" = TRAIN_GLUE=compiled (train_glue.py)
VARIANTS = ("transformers", "fused", "fused+bounds", "fused+bounds+glue")
REPS = 3  # timed forward + backward passes per variant, after one untimed (compilation)
CHECKPOINTING = True  # gradient checkpointing, as train_grpo's GRADIENT_CHECKPOINTING default
AUTOCAST = True  # bf16 autocast around the forward, as accelerate runs it with bf16=True
PROFILE = True  # one more pass per variant under torch.profiler: kernels by GPU time
ATTENTION_PROBE = True  # time the model's own flex attention calls (captured inputs) outside the model, variants


def build(s):
    import torch
    from peft import get_peft_model

    import train_grpo
    from tes_grpo.model.gpt_oss_shapes import build_random_model

    model = build_random_model(num_hidden_layers=s.LAYERS,
                               layer_types=["sliding_attention", "full_attention"] * (s.LAYERS // 2)
                               + ["sliding_attention"] * (s.LAYERS % 2))
    model.config.use_cache = False
    if s.CHECKPOINTING:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        model.enable_input_require_grads()
    model = get_peft_model(model, train_grpo.build_lora_config(4, 8))
    model.train()
    g = torch.Generator(device="cuda").manual_seed(0)
    ids = torch.randint(0, 200_000, (s.ROWS, s.LENGTH), device="cuda", generator=g)
    mask = torch.ones_like(ids)
    mask[1::2, :s.LEFT_PAD] = 0
    return model, ids, mask


def set_variant(model, variant: str) -> None:
    from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS

    from tes_grpo.experts.fused_experts import drop_fused_experts, use_fused_experts
    from tes_grpo.layers import train_glue
    from tes_grpo.patches.transformers_patches import flex_masks_with_padding_bounds

    experts, *extras = variant.split("+")
    drop_fused_experts(model)  # back to transformers' forward
    if experts == "fused":
        use_fused_experts(model)
    current = ALL_MASK_ATTENTION_FUNCTIONS["flex_attention"]
    if hasattr(current, "wraps_original"):
        ALL_MASK_ATTENTION_FUNCTIONS["flex_attention"] = current.wraps_original
    if "bounds" in extras:
        flex_masks_with_padding_bounds()
    train_glue.drop_train_glue(model)
    glue = train_glue.decide("cuda", "compiled") if "glue" in extras else None
    train_glue.rope_through(glue)
    train_glue.sinks_through(glue)
    if glue is not None:
        train_glue.use_train_glue(model, glue)


def train_pass(model, ids, mask, autocast: bool):
    import torch

    with torch.autocast("cuda", dtype=torch.bfloat16, enabled=autocast):
        hidden = model.base_model.model.model(input_ids=ids, attention_mask=mask).last_hidden_state
    hidden.float().square().mean().backward()


def profile_pass(fn) -> list[str]:
    import torch
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        fn()
        torch.cuda.synchronize()
    kernels = [e for e in prof.key_averages() if e.self_device_time_total > 0]
    total = sum(e.self_device_time_total for e in kernels)
    flex = {kind: [e for e in kernels if "flex_attention" in e.key and ("backward" in e.key) == (kind == "bwd")]
            for kind in ("fwd", "bwd")}
    lines = [f"  GPU busy {total / 1e3:.1f} ms; flex attention " + ", ".join(
        f"{kind} {sum(e.self_device_time_total for e in es) / 1e3:.1f} ms in {sum(e.count for e in es)} calls"
        for kind, es in flex.items())]
    for e in sorted(kernels, key=lambda e: -e.self_device_time_total)[:18]:
        lines.append(f"  {e.self_device_time_total / 1e3:>8.1f} ms {100 * e.self_device_time_total / total:>5.1f}% "
                     f"{e.count:>5}  {e.key[:100]}")
    return lines


def capture_attention(model, ids, mask, s, variant: str) -> dict:
    """{layer: (module, q, k, v, block mask, kwargs)} of each layer's flex attention call in one forward."""
    import torch
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

    set_variant(model, variant)
    original = ALL_ATTENTION_FUNCTIONS["flex_attention"]
    captured = {}

    def recording(module, query, key, value, attention_mask, **kwargs):
        captured.setdefault(module.layer_idx, (module, query, key, value, attention_mask, kwargs))
        return original(module, query, key, value, attention_mask, **kwargs)

    ALL_ATTENTION_FUNCTIONS["flex_attention"] = recording
    try:
        with torch.no_grad(), torch.autocast("cuda", dtype=torch.bfloat16, enabled=s.AUTOCAST):
            model.base_model.model.model(input_ids=ids, attention_mask=mask)
    finally:
        ALL_ATTENTION_FUNCTIONS["flex_attention"] = original
    return captured


def probe_attention(model, ids, mask, s) -> list[tuple]:
    """Times transformers' flex_attention_forward outside the model on the inputs of the model's own calls: as
    captured, with q/k/v made contiguous, with the block mask transformers builds from a bool attention mask (TRL's
    is int64), from padding bounds (patches.transformers_patches.flex_masks_with_padding_bounds), rebuilt as
    bench_flex_attention.py builds it, and without autocast."""
    import torch
    from torch.nn.attention.flex_attention import create_block_mask
    from transformers.integrations.flex_attention import flex_attention_forward

    captured = capture_attention(model, ids, mask, s, "transformers")
    bool_masks = {layer: c[4] for layer, c in capture_attention(model, ids, mask.bool(), s, "transformers").items()}
    bounds_masks = {layer: c[4] for layer, c in capture_attention(model, ids, mask, s, "transformers+bounds").items()}
    pad = (mask == 0).sum(-1)
    rows = []
    for layer in sorted(captured)[:2]:
        module, q, k, v, block_mask, kwargs = captured[layer]
        kind = "sliding" if kwargs.get("sliding_window") else "full"
        window = kwargs.get("sliding_window") or 10**9
        print(f"layer {layer} ({kind}): q {tuple(q.shape)} stride {q.stride()} {q.dtype}; k stride {k.stride()}; "
              f"mask {type(block_mask).__name__} {getattr(block_mask, 'shape', None)} block "
              f"{getattr(block_mask, 'BLOCK_SIZE', None)}; kwargs {sorted(kwargs)}")
        if hasattr(block_mask, "sparsity"):
            print(f"  sparsity {block_mask.sparsity():.1f}%")

        def rebuilt(b, h, qi, kv, window=window):
            return (kv <= qi) & (kv >= pad[b]) & (qi - kv < window)

        own_mask = create_block_mask(rebuilt, q.shape[0], None, q.shape[2], k.shape[2], device="cuda")
        grad = torch.randn(q.shape[0], q.shape[2], q.shape[1], q.shape[3], device="cuda", dtype=torch.bfloat16)
        cases = [("as captured", False, block_mask, s.AUTOCAST), ("q/k/v contiguous", True, block_mask, s.AUTOCAST),
                 ("bool attention mask", False, bool_masks[layer], s.AUTOCAST),
                 ("padding bounds", False, bounds_masks[layer], s.AUTOCAST),
                 ("mask rebuilt", False, own_mask, s.AUTOCAST), ("no autocast", False, block_mask, False)]
        for name, contiguous, use_mask, autocast in cases:
            # clone() keeps the captured strides (transposed views of the projections' outputs)
            qq, kk, vv = ((t.detach().contiguous() if contiguous else t.detach().clone()).requires_grad_()
                          for t in (q, k, v))

            def forward(qq=qq, kk=kk, vv=vv, use_mask=use_mask, autocast=autocast, module=module, kwargs=kwargs):
                with torch.autocast("cuda", dtype=torch.bfloat16, enabled=autocast):
                    return flex_attention_forward(module, qq, kk, vv, use_mask, **kwargs)[0]

            fwd = timed_ms(forward, s.REPS)
            both = timed_ms(lambda forward=forward, grad=grad: forward().backward(grad), s.REPS)
            rows.append((layer, kind, name, fwd, both))
            print(rows[-1], flush=True)
    return rows


def main(argv: list[str] | None = None) -> int:
    s = resolve(globals(), argv)
    import torch

    from benchmarks.log_header import header
    from tes_grpo.model.gpt_oss_shapes import stack_versions

    print(header(), flush=True)
    # the probe compiles flex attention for several masks and autocast states; past the default limit (8) torch
    # falls back to an unfused flex attention that holds the whole score matrix (and runs out of memory)
    torch._dynamo.config.recompile_limit = 64
    model, ids, mask = build(s)
    results, profiles = [], {}
    for variant in s.VARIANTS:
        set_variant(model, variant)
        torch.cuda.reset_peak_memory_stats()
        start = time.perf_counter()
        train_pass(model, ids, mask, s.AUTOCAST)
        torch.cuda.synchronize()
        first = time.perf_counter() - start
        ms = timed_ms(lambda: train_pass(model, ids, mask, s.AUTOCAST), s.REPS)
        model.zero_grad(set_to_none=True)
        peak = torch.cuda.max_memory_allocated() / 2**30
        results.append((variant, first, ms, peak))
        print(f"{variant}: first pass {first:.1f} s, then {ms:.0f} ms a pass, peak {peak:.1f} GiB", flush=True)
        if s.PROFILE:
            profiles[variant] = profile_pass(lambda: train_pass(model, ids, mask, s.AUTOCAST))
            model.zero_grad(set_to_none=True)
            print("\n".join(profiles[variant]), flush=True)
    probe = probe_attention(model, ids, mask, s) if s.ATTENTION_PROBE else []

    print(f"\n{stack_versions()}")
    print(f"{s.LAYERS} layers, {s.ROWS} rows x {s.LENGTH} tokens (every other row {s.LEFT_PAD} padded), LoRA r4, "
          f"checkpointing {s.CHECKPOINTING}, autocast {s.AUTOCAST}")
    print(f"{'variant':<14}{'first s':>8}{'ms/pass':>9}{'ms/layer':>9}{'x24 layers s':>13}{'peak GiB':>9}")
    for variant, first, ms, peak in results:
        print(f"{variant:<14}{first:>8.1f}{ms:>9.0f}{ms / s.LAYERS:>9.1f}{ms / s.LAYERS * 24 / 1e3:>13.2f}{peak:>9.1f}")
    if probe:
        print(f"\n{'layer':<6}{'kind':<9}{'flex attention call':<22}{'fwd ms':>8}{'fwd+bwd ms':>11}")
        for layer, kind, name, fwd, both in probe:
            print(f"{layer:<6}{kind:<9}{name:<22}{fwd:>8.2f}{both:>11.2f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
