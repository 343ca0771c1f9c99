"""gpt-oss with its frozen experts resident as MXFP4 (mxfp4_experts.py, model_loading.load_resident_model) against the
dequantized load: loading, the per-layer dequantization, and one MoE layer's training pass, on one GPU. Run on the GPU
machine (the numbers go to BENCHMARKS.md; a few minutes on an H100 at the 20B shapes):

    python benchmarks/bench_mxfp4_load.py
    python benchmarks/bench_mxfp4_load.py --LOAD_BF16=0                  # skip the dequantized load (the slow part)
    python benchmarks/bench_mxfp4_load.py --MODEL_SIZE=120b --LOAD=0     # 120B shapes: dequantization + one layer

1. LOAD: writes a random gpt-oss-{MODEL_SIZE}-shaped MXFP4 checkpoint under CHECKPOINT_DIR (bf16 non-expert weights,
   random expert blocks and scales, config.json as openai's; once, reused by later runs: ~13 GB at 20B, ~61 GiB at
   120B, so check the disk), then loads it in a fresh process each way: resident (load_training_model
   experts="mxfp4") and, with LOAD_BF16, dequantized (Mxfp4Config(dequantize=True)); each reports its load time,
   its peak host memory (VmHWM, and its rise over the process before loading) and the GPU memory allocated after
   the load and at its peak.
2. Dequantization of one layer's experts (gate_up + down -> [E, in, out] bf16): the Triton kernel
   (mxfp4_dequant.dequantize_with_triton, what a resident layer runs, from the Hopper layout the resident experts
   are kept in; at its DEQUANT_HOPPER and each of DEQUANT_TILES, and once from the checkpoint's layout),
   torch's codec, and transformers' own
   convert_moe_packed_tensors (what the dequantized load runs once); time, GB written per second, and whether the
   kernel's output equals transformers' bit for bit (this layer, and every byte x every scale value).
3. One MoE layer (router + experts) forward + backward at a training micro-batch of TOKENS tokens (16 x 2,335 at
   the recipe's 1,024-token completions), under non-reentrant gradient checkpointing as train_grpo trains it, for
   bf16 experts and resident MXFP4 experts, with each TRAIN_EXPERTS: time, the peak GPU memory above the weights,
   and whether output and input gradient equal the bf16 experts' bit for bit.

Last, a table of the three. RESULTS gets one JSON line per run.
"""

from __future__ import annotations

import sys as _sys
from pathlib import Path as _Path

_sys.path.insert(0, str(_Path(__file__).resolve().parents[1]))

import collections
import json
import math
import sys
import time
from collections.abc import Mapping
from pathlib import Path

from benchmarks.timing import timed_ms
from tes_grpo.run.script_config import resolve

MODEL_SIZE = "20b"  # gpt-oss shapes: 20b or 120b (gpt_oss_shapes.py)
LOAD = True  # write the random checkpoint (once) and time loading it
LOAD_BF16 = True  # also load it dequantized (Mxfp4Config(dequantize=True)), for comparison
CHECKPOINT_DIR = "runs/bench-mxfp4-load"  # the checkpoint goes to CHECKPOINT_DIR/gpt-oss-{MODEL_SIZE}-random
RESULTS = "runs/bench-mxfp4-load/results.jsonl"  # one JSON line per run is appended here
TOKENS = 37360  # tokens of the one-layer training pass (16 x 2,335: the recipe's micro-batch at 1,024 completions)
TRAIN_EXPERTS = ("fused", "transformers")  # train_grpo's TRAIN_EXPERTS variants timed for the one-layer pass
REPS = 5  # timed repetitions (after one untimed) for the dequantization and the layer pass
# Triton kernel programs also timed on the Hopper layout: rows/columns/warps (mxfp4_dequant.DEQUANT_HOPPER is the one
# used; rows a multiple of 128, columns of 64)
DEQUANT_TILES = ("128/64/8", "128/128/4", "128/128/8", "256/64/8")
SEED = 0  # random weights and inputs
OVERRIDES = ""  # JSON of GptOssConfig overrides (tests/test_bench_mxfp4_load.py shrinks the model with it)
PHASE = ""  # internal: "load-mxfp4" / "load-bf16" run one load in this (child) process and print its result

PRESETS = {"MODEL_SIZE": {"120b": {"LOAD_BF16": False}}}  # 216 GiB of dequantized experts fit no single GPU


def model_config(s):
    from tes_grpo.model.gpt_oss_shapes import gpt_oss_config

    return gpt_oss_config(s.MODEL_SIZE, **(json.loads(s.OVERRIDES) if s.OVERRIDES else {}))


def device() -> str:
    import torch

    return "cuda" if torch.cuda.is_available() else "cpu"


def synchronize() -> None:
    import torch

    if torch.cuda.is_available():
        torch.cuda.synchronize()


def host_peak_gib() -> float:
    """This process's peak resident host memory so far (VmHWM), GiB."""
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) / 2**20
    import resource

    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20


def gpu_gib(peak: bool = False) -> float:
    import torch

    if not torch.cuda.is_available():
        return 0.0
    return (torch.cuda.max_memory_allocated() if peak else torch.cuda.memory_allocated()) / 2**30


def checkpoint_path(s) -> Path:
    return Path(s.CHECKPOINT_DIR) / f"gpt-oss-{s.MODEL_SIZE}-random"


class _OnHost(Mapping):
    """A state dict read one tensor at a time onto the host (the writer keeps one shard, not the model, there)."""

    def __init__(self, state):
        self.state = state

    def __iter__(self):
        return iter(self.state)

    def __len__(self):
        return len(self.state)

    def __getitem__(self, name):
        return self.state[name].detach().cpu()


def write_checkpoint(s, folder: Path) -> None:
    """A random gpt-oss checkpoint in openai's MXFP4 layout, built resident on the device (no bf16 experts)."""
    import shutil

    import torch

    from tes_grpo.experts.mxfp4_checkpoint import write_mxfp4_checkpoint
    from tes_grpo.experts.mxfp4_experts import expected_shapes, is_resident, resident_state
    from tes_grpo.model.gpt_oss_shapes import build_random_model

    if (folder / "config.json").is_file():
        print(f"checkpoint: reusing {folder}")
        return
    overrides = json.loads(s.OVERRIDES) if s.OVERRIDES else {}
    model = build_random_model("eager", device(), size=s.MODEL_SIZE, resident=True, seed=s.SEED, **overrides)
    # the blocks and scales are non-persistent buffers, in the Hopper layout: resident_state gives each back in the
    # checkpoint's layout when read, one at a time (_OnHost), never all at once on the device
    resident = resident_state(model)
    state = collections.ChainMap(resident, model.state_dict())
    need = sum(t.nbytes for t in model.state_dict().values()) + sum(
        math.prod(shape) for module in model.modules() if is_resident(module)
        for shape in expected_shapes(module).values())
    folder.parent.mkdir(parents=True, exist_ok=True)
    free = shutil.disk_usage(folder.parent).free
    if free < need * 1.05:
        raise SystemExit(f"error: the checkpoint needs {need / 2**30:.1f} GiB, {folder.parent} has "
                         f"{free / 2**30:.1f} GiB free (CHECKPOINT_DIR elsewhere, or LOAD=0)")
    start = time.perf_counter()
    temp = folder.with_name(folder.name + ".tmp")
    shutil.rmtree(temp, ignore_errors=True)
    # the resident state already has the checkpoint's names: *_blocks / *_scales go through as they are
    write_mxfp4_checkpoint(_OnHost(state), model.config, temp)
    temp.rename(folder)
    print(f"checkpoint: wrote {need / 2**30:.1f} GiB to {folder} in {time.perf_counter() - start:.0f} s")
    del model
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


def load_once(s, experts: str) -> dict:
    """PHASE=load-*: one load in this fresh process; what it took."""
    import torch
    import transformers  # noqa: F401  (imported before the baseline, like the CUDA context: the load's own memory)

    from tes_grpo.model.model_loading import load_training_model

    if torch.cuda.is_available():  # the CUDA context before the baseline: the load's own memory is what counts
        torch.cuda.init()
        torch.cuda.reset_peak_memory_stats()
    before = host_peak_gib()
    start = time.perf_counter()
    model = load_training_model(str(checkpoint_path(s)), "eager", experts=experts)
    synchronize()
    seconds = time.perf_counter() - start
    resident = sum(1 for m in model.modules() if getattr(type(m), "mxfp4_resident", False))
    return {"experts": experts, "seconds": seconds, "host_peak_gib": host_peak_gib(),
            "host_rise_gib": host_peak_gib() - before, "gpu_gib": gpu_gib(), "gpu_peak_gib": gpu_gib(peak=True),
            "resident_layers": resident}


def load_in_child(s, experts: str, argv: list[str]) -> dict:
    import subprocess

    command = [sys.executable, str(Path(__file__).resolve()), *argv, f"--PHASE=load-{experts}"]
    done = subprocess.run(command, capture_output=True, text=True)
    if done.returncode != 0:
        raise SystemExit(f"error: the {experts} load failed:\n{done.stdout[-2000:]}\n{done.stderr[-4000:]}")
    line = [row for row in done.stdout.splitlines() if row.startswith("RESULT ")][-1]
    result = json.loads(line.removeprefix("RESULT "))
    print(f"load {experts}: {result['seconds']:.1f} s, host peak {result['host_peak_gib']:.1f} GiB (+"
          f"{result['host_rise_gib']:.1f}), GPU {result['gpu_gib']:.2f} GiB (peak {result['gpu_peak_gib']:.2f})",
          flush=True)
    return result


def bits_equal(a, b) -> bool:
    import torch

    if a.shape != b.shape or a.dtype != b.dtype:
        return False
    view = {1: torch.int8, 2: torch.int16, 4: torch.int32}[a.element_size()]
    return torch.equal(a.view(view), b.view(view))


def one_layer(s):
    """One MoE layer at the shapes: bf16 experts whose values are random MXFP4 blocks, and a resident twin holding
    those blocks."""
    import copy

    import torch
    from transformers.models.gpt_oss.modeling_gpt_oss import GptOssMLP

    from tes_grpo.experts.mxfp4_dequant import dequantize_experts
    from tes_grpo.experts.mxfp4_experts import make_resident
    from tes_grpo.model.gpt_oss_shapes import random_resident_blocks

    config = model_config(s)
    config._experts_implementation = "grouped_mm"
    torch.manual_seed(s.SEED)
    with torch.device(device()):
        mlp = GptOssMLP(config).to(torch.bfloat16)
    generator = torch.Generator(device=device()).manual_seed(s.SEED)
    blocks = random_resident_blocks(mlp.experts, generator, device())
    with torch.no_grad():
        for param in mlp.parameters():
            param.normal_(0.0, 0.02)
        for name in ("gate_up_proj", "down_proj"):
            getattr(mlp.experts, name).copy_(dequantize_experts(blocks[f"{name}_blocks"], blocks[f"{name}_scales"],
                                                                torch.bfloat16))
    mlp.requires_grad_(False)
    resident = copy.deepcopy(mlp)
    make_resident(resident.experts, blocks, torch.bfloat16)
    return mlp, resident, blocks


def dequantization(s, blocks) -> list[dict]:
    """Times each way of dequantizing one layer's experts; checks the Triton kernel against transformers."""
    import torch
    from transformers.integrations.mxfp4 import convert_moe_packed_tensors

    from tes_grpo.experts import mxfp4_dequant as dq
    from tes_grpo.experts.mxfp4 import to_hopper_layout
    from tes_grpo.triton_support import triton_installed

    projections = ("gate_up_proj", "down_proj")
    stored = {p: (to_hopper_layout(blocks[f"{p}_blocks"], "blocks"), to_hopper_layout(blocks[f"{p}_scales"], "scales"),
                  (blocks[f"{p}_blocks"].shape[1], blocks[f"{p}_blocks"].shape[2] * 32)) for p in projections}

    def both(fn):
        return [fn(blocks[f"{p}_blocks"], blocks[f"{p}_scales"]) for p in projections]

    def both_stored(fn):  # from the Hopper layout a resident module keeps (fn gets blocks, scales, size)
        return [fn(*stored[p]) for p in projections]

    reference = both(lambda b, sc: convert_moe_packed_tensors(b, sc, dtype=torch.bfloat16))
    written = sum(t.numel() * t.element_size() for t in reference)
    # (name, fn, whether fn reads the Hopper layout: blocks, scales, size; else the checkpoint's blocks, scales)
    ways = [("transformers convert_moe_packed_tensors",
             lambda b, sc: convert_moe_packed_tensors(b, sc, dtype=torch.bfloat16), False),
            ("torch codec (mxfp4_experts, per expert)", lambda b, sc: dq.dequantize_with_torch(b, sc, torch.bfloat16),
             False)]
    if device() == "cuda" and triton_installed():
        programs = [dq.DEQUANT_HOPPER] + [tuple(int(v) for v in t.split("/")) for t in s.DEQUANT_TILES]
        for i, program in enumerate(programs):
            ways.insert(i, (f"Triton kernel from the Hopper layout, program {'/'.join(map(str, program))}"
                            + (" (used)" if i == 0 else ""),
                            lambda b, sc, size, program=program: dq.dequantize_with_triton(
                                b, sc, torch.bfloat16, program, size=size), True))
        ways.insert(len(programs), ("Triton kernel from the checkpoint's layout",
                                    lambda b, sc: dq.dequantize_with_triton(b, sc, torch.bfloat16), False))
    every = (torch.arange(256, dtype=torch.uint8, device=device()).repeat(256).view(1, 256, 16, 16),
             torch.arange(256, dtype=torch.uint8, device=device()).view(1, 256, 1).expand(1, 256, 16).contiguous())
    rows = []
    for name, fn, tiled in ways:
        run = (lambda fn=fn: both_stored(fn)) if tiled else (lambda fn=fn: both(fn))
        equal = all(bits_equal(a, b) for a, b in zip(run(), reference, strict=True))
        every_in = ((to_hopper_layout(every[0], "blocks"), to_hopper_layout(every[1], "scales"), (256, 512)) if tiled
                    else every)
        table = bits_equal(fn(*every_in), convert_moe_packed_tensors(*every, dtype=torch.bfloat16))
        ms = timed_ms(run, s.REPS)
        rows.append({"way": name, "ms": ms, "gb_per_s": written / ms / 1e6, "equal_layer": equal,
                     "equal_every_byte_and_scale": table})
        print(f"dequantize: {name}: {ms:.2f} ms, {written / ms / 1e6:.0f} GB/s written, equal to transformers: "
              f"layer {equal}, every byte x scale {table}", flush=True)
    return rows


def layer_pass(mlp, hidden, grad):
    """One forward + backward of the MLP on `hidden` (a fresh leaf each time) under non-reentrant gradient
    checkpointing, as train_grpo trains: (output, d hidden)."""
    from torch.utils.checkpoint import checkpoint

    x = hidden.detach().requires_grad_()
    out = checkpoint(lambda t: mlp(t)[0], x, use_reentrant=False)
    out.backward(grad)
    return out.detach(), x.grad


def training_pass(s, mlp, resident) -> list[dict]:
    import torch

    from tes_grpo.experts.fused_experts import use_fused_experts

    g = torch.Generator(device=device()).manual_seed(s.SEED + 1)
    shape = (1, s.TOKENS, mlp.router.hidden_dim)
    hidden = torch.randn(shape, device=device(), generator=g).to(torch.bfloat16)
    grad = torch.randn(shape, device=device(), generator=g).to(torch.bfloat16) * 1e-3
    rows = []
    for variant in s.TRAIN_EXPERTS:
        if variant not in ("fused", "transformers"):
            raise SystemExit(f"error: TRAIN_EXPERTS: {variant!r} is not fused or transformers")
        outputs = {}
        for experts, module in (("bf16", mlp), ("mxfp4", resident)):
            if variant == "fused":
                use_fused_experts(module, say=print)
            else:
                module.experts.__dict__.pop("forward", None)  # transformers' forward again
            outputs[experts] = layer_pass(module, hidden, grad)
            synchronize()
            if torch.cuda.is_available():
                torch.cuda.reset_peak_memory_stats()
            base = gpu_gib()
            ms = timed_ms(lambda module=module: layer_pass(module, hidden, grad), s.REPS)
            row = {"experts": experts, "train_experts": variant, "ms": ms, "peak_above_gib": gpu_gib(True) - base}
            if experts == "mxfp4":
                a, b = outputs["bf16"], outputs["mxfp4"]
                row["equal_to_bf16"] = bits_equal(a[0], b[0]) and bits_equal(a[1], b[1])
            rows.append(row)
            print(f"layer pass: {experts} experts, TRAIN_EXPERTS={variant}: {ms:.1f} ms, peak +"
                  f"{row['peak_above_gib']:.2f} GiB" + (f", equal to bf16: {row['equal_to_bf16']}"
                                                         if "equal_to_bf16" in row else ""), flush=True)
    return rows


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    s = resolve(globals(), argv, presets=PRESETS)
    bad = [t for t in s.DEQUANT_TILES if len(t.split("/")) != 3 or not all(v.isdigit() for v in t.split("/"))]
    if bad:
        print(f"error: DEQUANT_TILES: {bad[0]!r} is not rows/columns/warps (three whole numbers)", file=sys.stderr)
        return 2
    if s.PHASE:
        if s.PHASE not in ("load-mxfp4", "load-bf16"):
            print(f"error: PHASE={s.PHASE!r} is internal (load-mxfp4 or load-bf16)", file=sys.stderr)
            return 2
        print("RESULT " + json.dumps(load_once(s, s.PHASE.removeprefix("load-"))), flush=True)
        return 0
    from benchmarks.log_header import header
    from tes_grpo.model.gpt_oss_shapes import stack_versions

    print(header(), flush=True)
    config = model_config(s)
    loads = []
    if s.LOAD:
        write_checkpoint(s, checkpoint_path(s))
        loads.append(load_in_child(s, "mxfp4", argv))
        if s.LOAD_BF16:
            loads.append(load_in_child(s, "bf16", argv))
    mlp, resident, blocks = one_layer(s)
    dequant = dequantization(s, blocks)
    layer = training_pass(s, mlp, resident)
    results = Path(s.RESULTS)
    results.parent.mkdir(parents=True, exist_ok=True)
    with results.open("a") as f:
        f.write(json.dumps({"model_size": s.MODEL_SIZE, "tokens": s.TOKENS, "loads": loads, "dequantize": dequant,
                            "layer": layer, "versions": stack_versions()}) + "\n")

    experts, hidden, inter = config.num_local_experts, config.hidden_size, config.intermediate_size
    print(f"\n{stack_versions()}; gpt-oss-{s.MODEL_SIZE} shapes ({config.num_hidden_layers} layers x {experts} "
          f"experts, hidden {hidden}, intermediate {inter}), device {device()}")
    if loads:
        print(f"{'load (fresh process)':<34}{'s':>7}{'host peak GiB':>15}{'(rise)':>8}{'GPU GiB':>9}{'GPU peak':>10}"
              f"{'resident layers':>17}")
        for r in loads:
            name = "resident MXFP4 experts" if r["experts"] == "mxfp4" else "dequantized (Mxfp4Config)"
            print(f"{name:<34}{r['seconds']:>7.1f}{r['host_peak_gib']:>15.1f}{r['host_rise_gib']:>8.1f}"
                  f"{r['gpu_gib']:>9.2f}{r['gpu_peak_gib']:>10.2f}{r['resident_layers']:>17}")
    print(f"{'dequantize one layer -> bf16':<44}{'ms':>8}{'GB/s':>7}  equal to transformers (layer / all bytes)")
    for r in dequant:
        print(f"{r['way'][:43]:<44}{r['ms']:>8.2f}{r['gb_per_s']:>7.0f}  {r['equal_layer']} / "
              f"{r['equal_every_byte_and_scale']}")
    print(f"{f'one MoE layer fwd+bwd, {s.TOKENS} tokens':<44}{'ms':>8}{'peak+GiB':>10}  equal to bf16 experts")
    for r in layer:
        print(f"{r['experts'] + ' experts, TRAIN_EXPERTS=' + r['train_experts']:<44}{r['ms']:>8.1f}"
              f"{r['peak_above_gib']:>10.2f}  {r.get('equal_to_bf16', '-')}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
