"""Where one captured decode step of a gpt-oss-20b-shaped model goes, kernel group by kernel group, against the
bytes each group must move (decode_limit.py).

Run on the GPU machine (the table goes to BENCHMARKS.md):

    python benchmarks/profile_decode.py --KERNELS_OUT=runs/profile-kernels.tsv
    python benchmarks/profile_decode.py --DEVICE=cpu --ATTN=eager --EXPERTS=model --NUM_SEQS=4 --PROMPT_LEN=40 \
        --NEW_TOKENS=64 --DECODE_AT=8 --WALL_STEPS=4 --PROFILE_STEPS=2 --REPLAYS=2 --OVERRIDES="$TINY"
        # CPU, tiny shapes (TINY: tests/test_profile_decode.py's): the flow only, CPU ops standing in for kernels

The run is GRPO's decode as bench_generate.py times it: NUM_SEQS sequences = NUM_PROMPTS prompts x NUM_SEQS /
NUM_PROMPTS, PROMPT_LEN tokens left-padded (up to PROMPT_LEN_SPREAD shorter), train_grpo's LoRA adapter of rank
LORA_R in train mode (B drawn to LORA_RHO), decoded by graph_decode with EXPERTS, DECODE_LORA and DECODE_GLUE under
the trainer's autocast, random 20B-shaped weights (gpt_oss_shapes.py). After the real prefill, the cache sized for
NEW_TOKENS, the decode step that writes the cache after DECODE_AT new tokens (bench_generate's mean cache length at
the defaults) is captured as a CUDA graph and:
- timed: its replays back to back (CUDA events: GPU time a step) and graph_decode.generate's own loop over
  WALL_STEPS steps (wall time a step: the replay, sampling, the host's launches and its per-step read of whether
  every row has ended), the prefill, weights and step runner handed to generate ready-made (`ready_made`) so the
  loop is the real one at that cache length;
- profiled (torch.profiler, CUDA activity): PROFILE_STEPS replays, and the same loop with the step replaced by fixed
  logits (the sampling kernels alone: temperature, softmax over the vocabulary, the multinomial draw, the recorded
  log-probability). If the replays hide their kernels from the profiler, the eager step is profiled instead (said);
- grouped: each call site of the step (attention projections with LoRA, the decode attention with its sink step on
  a full and a sliding layer, KV write, router + MXFP4 experts, LM head, a residual add with its norm and the rotary
  embedding) runs once more under the profiler on its own (`probe`),
  which says what kernels, for how long, each site launches; `allocate` shares each replayed kernel's time among
  the sites that launched it and gives what is left to the first of RULES (kernel-name patterns) it matches.
  Names no site launched and no rule matches are printed as ungrouped.

The table printed last has per group: time a step, the bytes it must move (decode_limit's accounting at this
step's cache length, the experts hit as measured from the router in one eager step), the GB/s it reaches, and its
time at the copy rate; "gaps between kernels" is the step's wall time less the kernel time. KERNELS_OUT gets every
kernel (phase, name, count and us a step, the groups its time went to).
"""

from __future__ import annotations

import sys as _sys
from pathlib import Path as _Path

# Run as `python benchmarks/<name>.py` from the repo root: Python puts benchmarks/ on sys.path, not the root
# that holds train_grpo.py and the tes_grpo package.
_sys.path.insert(0, str(_Path(__file__).resolve().parents[1]))

import contextlib
import json
import re
import time

from benchmarks import decode_limit
from tes_grpo.run.script_config import resolve

NUM_SEQS = 64  # sequences decoded together
NUM_PROMPTS = 4  # distinct prompts among them, each repeated NUM_SEQS / NUM_PROMPTS times (GRPO's groups)
PROMPT_LEN = 1316  # prompt tokens per sequence, padding included
PROMPT_LEN_SPREAD = 40  # distinct prompts are up to this many tokens shorter, left-padded (as TRL pads)
NEW_TOKENS = 1024  # the static cache is sized for this many new tokens (bench_generate's run)
DECODE_AT = 512  # the profiled step writes the cache after this many new tokens (mean cache of a 1,024-token run)
WALL_STEPS = 200  # steps of generate's loop timed for the wall time a step (all in DECODE_AT's cache bucket)
PROFILE_STEPS = 20  # replays (and sampling steps) under the profiler
REPLAYS = 50  # back-to-back replays timed with CUDA events
LORA_R = 4  # train_grpo's LoRA adapter of this rank, in train mode (0 = none)
LORA_RHO = 1e-3  # its B drawn so that rms(LoRA delta) / rms(W) = this (bench_generate.grpo_state)
EXPERTS = "mxfp4"  # graph_decode's experts: mxfp4 (the MXFP4 kernel) or model (the model's own MLP)
DECODE_LORA = "peft"  # graph_decode's lora: peft (PEFT's order) or merged
DECODE_GLUE = "compiled"  # graph_decode's glue: compiled (train_grpo's default on a GPU; eager on a CPU) or eager
AUTOCAST = "bf16"  # the trainer's autocast, which graph_decode decodes under: bf16 or none
ATTN = "flex_attention"  # the model's attention (its prefill): flex_attention (GPU), eager (the CPU check)
DEVICE = "cuda"  # cuda, or cpu for a check of the flow at tiny OVERRIDES (no graphs, CPU ops for kernels)
OVERRIDES = ""  # JSON of GptOssConfig overrides (tiny shapes for the CPU check)
SEED = 0  # weights, prompts and tokens
KERNELS_OUT = ""  # the full kernel list is written here (tab-separated); "" = not written

MOE = "MoE experts (MXFP4 kernel)"
ROUTING = "router + top-k"
ATTENTION = "attention (decode kernel, sinks)"
PROJECTIONS = "attention projections + LoRA"
ELEMENTWISE = "norms, RoPE, elementwise"
HEAD = "LM head"
SAMPLING = "sampling"
KV_WRITES = "KV writes"
GAPS = "gaps between kernels"
GROUPS = (MOE, ROUTING, ATTENTION, PROJECTIONS, ELEMENTWISE, HEAD, SAMPLING, KV_WRITES)

# Kernel-name patterns (re.search, first match wins) for the time no probed call site accounts for: the step's
# own glue (norms, RoPE, masks, residual adds, the embedding, the graph's input copies) and anything a probe missed.
RULES = (
    (MOE, r"experts_kernel"),  # mxfp4_kernels.experts_kernel (named _experts_kernel in logs before 2026-11-27)
    (ATTENTION, r"flex|triton_tem_|attention_kernel|combine_kernel"),  # decode_attention's kernels, flex attention's
    (ROUTING, r"[Tt]op[Kk]|[Ss]ort|searchsorted"),
    (PROJECTIONS, r"linear_kernel"),  # decode_linear's kernel
    (KV_WRITES, r"index_copy|indexFunc|index_put"),
    (ELEMENTWISE, r"elementwise|reduce_kernel|Reduce|gather|index_select|indexSelect|CatArrayBatched|cat_|"
                  r"[Ff]ill|[Cc]opy|[Mm]emcpy|[Mm]emset|triton_(poi|per|red)_|^aten::"),  # + the compiled glue
)

# decode_limit's items that each group must move (the sampling group: the float32 logits, outside the limit)
GROUP_ITEMS = {
    MOE: (decode_limit.EXPERTS,), ROUTING: (decode_limit.ROUTER,),
    ATTENTION: (decode_limit.KV_FULL, decode_limit.KV_SLIDING), PROJECTIONS: (decode_limit.PROJECTIONS,),
    ELEMENTWISE: (decode_limit.SMALL,), HEAD: (decode_limit.LM_HEAD,), KV_WRITES: (decode_limit.KV_WRITES,),
}


def rule_group(name: str, rules=RULES) -> str | None:
    """The group of the first rule whose pattern is found in the kernel name, or None."""
    for group, pattern in rules:
        if re.search(pattern, name):
            return group
    return None


def allocate(step_us: dict, expected: dict, rules=RULES) -> dict:
    """Shares a step's kernel time among groups: {kernel name: {group or None (ungrouped): us}}.

    step_us: us a step per kernel name; expected: {group: {kernel name: us a step}} as the probes of that group's
    call sites measured them. Each name's time goes first to the groups that expect it, in proportion to what each
    expects and at most that much; what is left goes to the name's rule group, else back to the expecting groups in
    the same proportion; a name that no group expects and no rule matches is ungrouped (None)."""
    out = {}
    for name, us in step_us.items():
        demand = {group: names[name] for group, names in expected.items() if names.get(name, 0) > 0}
        wanted = sum(demand.values())
        taken = min(us, wanted)
        shares = {group: taken * d / wanted for group, d in demand.items()}
        left = us - taken
        if left > 0:
            group = rule_group(name, rules)
            if group is None and demand:
                for g, d in demand.items():
                    shares[g] += left * d / wanted
            else:
                shares[group] = shares.get(group, 0.0) + left
        out[name] = shares
    return out


def group_totals(assigned: dict) -> dict:
    """{group or None: us a step} of allocate's result."""
    totals = {}
    for shares in assigned.values():
        for group, us in shares.items():
            totals[group] = totals.get(group, 0.0) + us
    return totals


def split_probe(site_us: dict, rules=RULES, default: str = ROUTING) -> dict:
    """The MoE site's kernels by group: those RULES give to the experts kernel (MOE), the rest to `default` (the
    router, top-k and the rows' sort around it)."""
    out = {MOE: {}, default: {}}
    for name, us in site_us.items():
        out[MOE if rule_group(name, rules) == MOE else default][name] = us
    return out


def _sync(device) -> None:
    import torch

    if device.type == "cuda":
        torch.cuda.synchronize(device)


def kernel_times(fn, repeats: int, device) -> dict:
    """{name: (count, us)} per call of fn, from torch.profiler over `repeats` calls: CUDA kernels (and copies) on a
    GPU; on a CPU the aten ops' self time stands in for them."""
    from torch.profiler import ProfilerActivity, profile

    cuda = device.type == "cuda"
    with profile(activities=[ProfilerActivity.CUDA if cuda else ProfilerActivity.CPU]) as prof:
        for _ in range(repeats):
            fn()
        _sync(device)
    out = {}
    for event in prof.key_averages():
        us = event.self_device_time_total if cuda else event.self_cpu_time_total
        if us > 0 and (cuda or event.key.startswith("aten::")):
            out[event.key] = (event.count / repeats, us / repeats)
    return out


def probe(fn, calls: int, device) -> dict:
    """{kernel name: us a step} of a call site that a step calls `calls` times: fn once to warm up, then profiled."""
    fn()
    _sync(device)
    return {name: us * calls for name, (_, us) in kernel_times(fn, 3, device).items()}


class Offset:
    """A decode-step runner that writes `offset` slots further on: generate's loop at a longer cache."""

    def __init__(self, step, offset: int):
        self.step, self.offset = step, offset

    def __call__(self, tokens, slot: int):
        return self.step(tokens, slot + self.offset)


@contextlib.contextmanager
def ready_made(graph_decode, logits, cache, weights, step):
    """graph_decode.generate with its prefill, decode weights and step runner replaced by ones made already (the loop
    itself is generate's own); raises if generate did not ask for all three (the module changed under us)."""
    called = set()
    made = {"prefill": (logits, cache), "decode_weights": weights, "decode_steps": step}
    originals = {name: getattr(graph_decode, name) for name in made}

    def stand_in(name):
        def give(*args, **kwargs):
            called.add(name)
            return made[name]
        return give

    for name in made:
        setattr(graph_decode, name, stand_in(name))
    try:
        yield
    finally:
        for name, original in originals.items():
            setattr(graph_decode, name, original)
    if called != set(made):
        raise RuntimeError(f"graph_decode.generate did not call {sorted(set(made) - called)}: profile_decode's "
                           "stand-ins no longer reach its loop")


def measured_experts_hit(decode_math, lm, cache, tokens, slot, length: int, weights) -> float:
    """Mean number of distinct experts the routers pick per layer in one eager decode step (router forward hooks)."""
    import torch

    hits = []
    hooks = [layer.mlp.router.register_forward_hook(lambda m, i, out: hits.append(int(out[2].unique().numel())))
             for layer in lm.model.layers]
    try:
        decode_math.decode_step(lm, cache, tokens, torch.tensor(slot, device=tokens.device), length, weights)
    finally:
        for hook in hooks:
            hook.remove()
    if len(hits) != len(lm.model.layers):
        raise RuntimeError(f"router hooks fired {len(hits)} times for {len(lm.model.layers)} layers")
    return sum(hits) / len(hits)


def site_probes(decode_math, lm, cache, weights, slot: int, length: int, autocast, device) -> dict:
    """{group: {kernel name: us a step}} of each call site of the decode step, probed on its own (see probe)."""
    import torch

    from tes_grpo.experts.mxfp4_decode import moe_forward

    config = lm.config
    batch = cache.keys[0].shape[0]
    layers = lm.model.layers
    full = next(i for i, s in enumerate(cache.sliding) if not s)
    sliding = [i for i, s in enumerate(cache.sliding) if s]
    hidden = torch.randn(batch, 1, config.hidden_size, device=device, dtype=cache.keys[0].dtype)
    # laid out as decode_step's query (a transposed view), so the compiled attention's guards hold
    query = torch.randn(batch, 1, config.num_attention_heads, config.head_dim, device=device,
                        dtype=hidden.dtype).transpose(1, 2)
    key = torch.randn(batch, config.num_key_value_heads, 1, config.head_dim, device=device, dtype=hidden.dtype)
    slot_t = torch.tensor(slot, device=device)
    full_mask, ring_mask = cache.masks(slot_t, length)
    glue = weights.glue
    attend = decode_math.attention_function(hidden, glue)
    projections = weights.attention
    packs = weights.experts

    def under_autocast(fn):
        def run():
            with decode_math.autocast_context(device, autocast), torch.no_grad():
                return fn()
        return run

    def attention(i):
        keys = cache.keys[i] if cache.sliding[i] else cache.keys[i][:, :, :length]
        values = cache.values[i] if cache.sliding[i] else cache.values[i][:, :, :length]
        mask = ring_mask if cache.sliding[i] else full_mask
        for t, dim in ((keys, 2), (values, 2), (mask, 1)):
            torch._dynamo.maybe_mark_dynamic(t, dim)  # as decode_step marks them: the compiled kernel is reused
        attn = layers[i].self_attn
        seen = None if cache.sliding[i] else slot_t + 1  # as decode_step passes it
        return lambda: attend(query, keys, values, mask, attn.sinks, attn.scaling, seen)

    attn = layers[full].self_attn
    proj = projections[full] if projections is not None else None
    x = glue.norm(hidden, layers[full].input_layernorm)
    # the rotary embedding's key laid out as decode_step's (a transposed view), for the compiled glue's guards
    rope_key = torch.randn(batch, 1, config.num_key_value_heads, config.head_dim, device=device,
                           dtype=hidden.dtype).transpose(1, 2)
    cos, sin = lm.model.rotary_emb(hidden, slot_t.view(1, 1))
    delta = torch.randn_like(hidden)
    attended = torch.randn(batch, 1, config.num_attention_heads * config.head_dim, device=device, dtype=hidden.dtype)
    mlp = layers[full].mlp
    if packs is not None and packs[full] is not None:
        def moe():
            return moe_forward(mlp, packs[full], x)
    else:
        def moe():
            return mlp(x)
    expected = {
        PROJECTIONS: probe(under_autocast(lambda: (decode_math.qkv_projections(attn, proj, x, glue),
                                                   decode_math.output_projection(attn, proj, attended, glue))),
                           len(layers), device),
        KV_WRITES: probe(under_autocast(lambda: cache.write(full, slot_t, key, key, length)), len(layers), device),
        HEAD: probe(under_autocast(lambda: decode_math.head_logits(lm, hidden)), 1, device),
    }
    attention_us = probe(under_autocast(attention(full)), len(layers) - len(sliding), device)
    if sliding:
        for name, us in probe(under_autocast(attention(sliding[0])), len(sliding), device).items():
            attention_us[name] = attention_us.get(name, 0.0) + us
    expected[ATTENTION] = attention_us
    # the glue between the products: two residual adds with their norms and one rotary embedding a layer (the
    # step's first norm, once, is left to RULES)
    glue_us = probe(under_autocast(lambda: glue.add_norm(hidden, delta, layers[full].post_attention_layernorm)),
                    2 * len(layers), device)
    for name, us in probe(under_autocast(lambda: glue.rope_qk(query, rope_key, cos, sin)), len(layers),
                          device).items():
        glue_us[name] = glue_us.get(name, 0.0) + us
    expected[ELEMENTWISE] = glue_us
    expected.update(split_probe(probe(under_autocast(moe), len(layers), device)))
    return expected


def group_table(totals: dict, wall_us: float, kernel_us: float, items: dict, logits_bytes: float,
                rate: float | None) -> list[tuple]:
    """Rows (group, us a step, share of the step, GB it must move, GB/s, us at the copy rate) for the groups, the
    gaps, the ungrouped time and the whole step; bytes from decode_limit's items (GROUP_ITEMS), the sampling group's
    the logits read once."""
    rows = []
    for group in GROUPS:
        moved = logits_bytes if group == SAMPLING else sum(items[i] for i in GROUP_ITEMS[group])
        rows.append((group, totals.get(group, 0.0), moved))
    if totals.get(None):
        rows.append(("ungrouped kernels", totals[None], 0.0))
    rows.append((GAPS, wall_us - kernel_us, 0.0))
    rows.append(("whole step (wall)", wall_us, float(sum(items.values()))))
    out = []
    for name, us, moved in rows:
        speed = moved / (us * 1e-6) / 1e9 if us > 0 and moved else float("nan")
        floor = moved / rate * 1e6 if rate and moved else float("nan")
        out.append((name, us, us / wall_us if wall_us else float("nan"), moved / 1e9, speed, floor))
    return out


def print_kernels(title: str, kernels: dict, top: int) -> None:
    print(f"\n{title}: {sum(us for _, us in kernels.values()):.0f} us a step")
    print(f"{'us/step':>9}{'count':>7}  kernel")
    for name, (count, us) in sorted(kernels.items(), key=lambda kv: -kv[1][1])[:top]:
        print(f"{us:>9.1f}{count:>7.1f}  {name[:110]}")


def main(argv: list[str] | None = None) -> int:
    s = resolve(globals(), argv)
    if s.EXPERTS not in ("mxfp4", "model") or s.DECODE_LORA not in ("peft", "merged"):
        raise SystemExit(f"error: EXPERTS={s.EXPERTS!r} / DECODE_LORA={s.DECODE_LORA!r}: mxfp4 or model / peft or "
                         "merged")
    if s.DECODE_GLUE not in ("eager", "compiled"):
        raise SystemExit(f"error: DECODE_GLUE={s.DECODE_GLUE!r}: eager or compiled")
    if s.NUM_SEQS % s.NUM_PROMPTS:
        raise SystemExit(f"error: NUM_SEQS={s.NUM_SEQS} is not a multiple of NUM_PROMPTS={s.NUM_PROMPTS}")
    import torch
    from transformers import GenerationConfig

    from benchmarks.bench_generate import autocast_dtype, grpo_prompts, grpo_state, token_ids
    from benchmarks.log_header import header
    from tes_grpo.layers.lora import causal_lm
    from tes_grpo.model.gpt_oss_shapes import build_random_model
    from tes_grpo.sampling import decode_cache, decode_math, graph_decode

    device = torch.device(s.DEVICE)
    cuda = device.type == "cuda"
    torch.manual_seed(s.SEED)
    rate = decode_limit.measure_copy_rate(device) if cuda else None
    print(header(copy_rate=rate, device=device), flush=True)
    if not cuda:
        print("copy rate: none (CPU run; the flow only)")
    overrides = json.loads(s.OVERRIDES) if s.OVERRIDES else {}
    model = build_random_model(s.ATTN, device=s.DEVICE, mxfp4_experts=True, seed=s.SEED, **overrides)
    model.requires_grad_(False)
    config = model.config
    if s.LORA_R:
        model = grpo_state(model, s.LORA_R, rho=s.LORA_RHO)
    autocast = autocast_dtype(s.AUTOCAST)
    lm = causal_lm(model)
    ids, mask = grpo_prompts(s.NUM_SEQS, s.NUM_PROMPTS, s.PROMPT_LEN, s.PROMPT_LEN_SPREAD, model, s.SEED)
    vocab, pad = token_ids(model)
    slot = s.PROMPT_LEN + s.DECODE_AT
    with torch.no_grad():
        logits, cache = decode_cache.prefill(lm, ids, mask, s.NEW_TOKENS, pad, autocast=autocast)
        weights = decode_math.decode_weights(lm, s.EXPERTS, s.DECODE_LORA, autocast, glue=s.DECODE_GLUE)
        length = decode_cache.bucket_length(slot, cache.total)
        last = slot + max(s.WALL_STEPS, s.PROFILE_STEPS)
        if last >= cache.total or decode_cache.bucket_length(last, cache.total) != length:
            raise SystemExit(f"error: the steps from slot {slot} to {last} leave the cache bucket of {length} slots "
                             f"(cache {cache.total}): lower WALL_STEPS / PROFILE_STEPS or move DECODE_AT")
        tokens = torch.randint(0, vocab, (s.NUM_SEQS, 1), device=device)
        hit = measured_experts_hit(decode_math, lm, cache, tokens, slot, length, weights)
        runner = decode_cache.decode_steps(lm, cache, s.NUM_SEQS, device, cuda, weights)
        for _ in range(3):  # the first call captures (cuda) or compiles nothing (cpu)
            fixed = runner(tokens, slot)
        _sync(device)

        # GPU time of a step: replays back to back
        if cuda:
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            for _ in range(s.REPLAYS):
                runner(tokens, slot)
            end.record()
            end.synchronize()
            replay_us = 1e3 * start.elapsed_time(end) / s.REPLAYS
        else:
            begin = time.perf_counter()
            for _ in range(s.REPLAYS):
                runner(tokens, slot)
            replay_us = 1e6 * (time.perf_counter() - begin) / s.REPLAYS

        # wall time of a step in generate's own loop at this cache length
        def generate(new_tokens: int, step):
            config_ = GenerationConfig(max_new_tokens=new_tokens, do_sample=True, temperature=1.0, top_p=1.0,
                                       pad_token_id=pad, eos_token_id=None)
            with ready_made(graph_decode, logits, cache, weights, step):
                out = graph_decode.generate(model, ids, mask, config_, graphs=cuda, experts=s.EXPERTS,
                                            lora=s.DECODE_LORA, autocast=autocast, logprobs=True,
                                            glue=s.DECODE_GLUE)
            _sync(device)
            return out

        def timed(new_tokens: int) -> float:
            _sync(device)
            begin = time.perf_counter()
            generate(new_tokens, Offset(runner, s.DECODE_AT))
            return time.perf_counter() - begin

        timed(s.WALL_STEPS + 1)  # warm: the sampler's kernels
        wall_us = 1e6 * (timed(s.WALL_STEPS + 1) - timed(1)) / s.WALL_STEPS

        replayed = kernel_times(lambda: runner(tokens, slot), s.PROFILE_STEPS, device)
        profiled = "replays of the captured graph" if cuda else "eager steps (CPU)"
        seen_us = sum(us for _, us in replayed.values())
        if cuda and seen_us < 0.5 * replay_us:
            print(f"\nthe profiler saw {seen_us:.0f} us of kernels a replay against {replay_us:.0f} us of replay time: "
                  "graph replays hide their kernels here; profiling the eager step at the same shapes instead")
            eager = decode_cache.decode_steps(lm, cache, s.NUM_SEQS, device, False, weights)
            eager(tokens, slot)
            replayed = kernel_times(lambda: eager(tokens, slot), s.PROFILE_STEPS, device)
            profiled = "eager steps (graph replays hid their kernels)"
        # one generate call of PROFILE_STEPS + 1 tokens samples that many times
        sampled = kernel_times(lambda: generate(s.PROFILE_STEPS + 1, lambda t, n: fixed), 1, device)
        sampling = {name: (count / (s.PROFILE_STEPS + 1), us / (s.PROFILE_STEPS + 1))
                    for name, (count, us) in sampled.items()}
        expected = site_probes(decode_math, lm, cache, weights, slot, length, autocast, device)

    step_us = {name: us for name, (_, us) in replayed.items()}
    assigned = allocate(step_us, expected)
    totals = group_totals(assigned)
    totals[SAMPLING] = totals.get(SAMPLING, 0.0) + sum(us for _, us in sampling.values())
    kernel_us = sum(step_us.values()) + sum(us for _, us in sampling.values())
    context = float(mask.sum(dim=1).float().mean()) + s.DECODE_AT + 1
    fmt = decode_limit.experts_format(s.EXPERTS, False)
    moved = decode_limit.decode_bytes(config, s.NUM_SEQS, context, fmt, s.LORA_R, experts_hit=hit)
    logits_bytes = s.NUM_SEQS * config.vocab_size * 4  # float32 logits, read once by the sampler

    print_kernels(f"kernels of the decode step ({profiled}, {s.PROFILE_STEPS} profiled)", replayed, 30)
    print_kernels("kernels of sampling (generate's loop, the step's logits fixed)", sampling, 15)
    ungrouped = {name: shares[None] for name, shares in assigned.items() if shares.get(None)}
    print(f"\nkernels no probe launched and no rule matched ({len(ungrouped)}; RULES in profile_decode.py):")
    for name, us in sorted(ungrouped.items(), key=lambda kv: -kv[1]):
        print(f"  {us:>8.1f} us  {name[:110]}")
    if s.KERNELS_OUT:
        path = _Path(s.KERNELS_OUT)
        path.parent.mkdir(parents=True, exist_ok=True)
        with path.open("w") as f:
            f.write("phase\tkernel\tcount a step\tus a step\tgroups (us a step)\n")
            for name, (count, us) in sorted(replayed.items(), key=lambda kv: -kv[1][1]):
                groups = ", ".join(f"{g or 'ungrouped'} {v:.1f}" for g, v in assigned[name].items())
                f.write(f"step\t{name}\t{count:g}\t{us:.2f}\t{groups}\n")
            for name, (count, us) in sorted(sampling.items(), key=lambda kv: -kv[1][1]):
                f.write(f"sampling\t{name}\t{count:g}\t{us:.2f}\t{SAMPLING} {us:.1f}\n")
        print(f"kernel list: {path}")

    flex_slots = sum(not sl for sl in cache.sliding) * s.NUM_SEQS * length * 2 * config.num_key_value_heads \
        * config.head_dim * 2
    print(f"\n{s.NUM_SEQS} sequences = {s.NUM_PROMPTS} prompts x {s.NUM_SEQS // s.NUM_PROMPTS}, prompt {s.PROMPT_LEN} "
          f"tokens (up to {s.PROMPT_LEN_SPREAD} fewer real), step after {s.DECODE_AT} new tokens: cache {context:.0f} "
          f"real tokens, full-attention layers attend over {length} slots (the bucket: "
          f"{flex_slots / 1e9:.3f} GB of full-layer cache read against "
          f"{moved.items[decode_limit.KV_FULL] / 1e9:.3f} GB needed); experts {s.EXPERTS}, LoRA r{s.LORA_R} "
          f"{s.DECODE_LORA}, rho {s.LORA_RHO}, autocast {s.AUTOCAST}")
    print("\n".join(moved.lines(rate)))
    print(f"step: wall {wall_us:.0f} us in generate's loop ({s.WALL_STEPS} steps), replay alone {replay_us:.0f} us "
          f"(GPU, {s.REPLAYS} back to back), kernels {kernel_us:.0f} us (step {sum(step_us.values()):.0f} + sampling "
          f"{sum(us for _, us in sampling.values()):.0f}); profiled: {profiled}")
    print(f"\n{'group':<32}{'us/step':>9}{'share':>8}{'GB':>9}{'GB/s':>8}{'us at copy rate':>16}")
    for name, us, share, gb, speed, floor in group_table(totals, wall_us, kernel_us, moved.items, logits_bytes,
                                                         rate):
        print(f"{name:<32}{us:>9.1f}{100 * share:>7.1f}%{gb:>9.3f}{speed:>8.0f}{floor:>16.1f}")
    return 0


if __name__ == "__main__":
    _sys.exit(main())
