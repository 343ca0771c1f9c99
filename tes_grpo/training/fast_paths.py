"""Which fast paths a GRPO run takes, decided once: the one place that chooses kernels.

train_grpo.py calls `check_settings(s)` with its other setting checks (before anything slow); the trainer
(trainer.py), once TRL has wrapped the model in LoRA, calls `choose(s, trainer, cuda)`, which returns the decisions
with their reasons (FastPaths), `install(trainer, paths)`, which applies the training side of them, and builds the
sampler `paths.sampler` names (sampling/sampler.py). The settings:

- DECODE_GRAPHS (auto | on | off): sample with graph_decode.py (static KV cache, each decode step replayed as a
  CUDA graph) instead of transformers' generate. auto = on when graph_decode.auto_decode_graphs finds nothing in
  this model, machine or parallel setup that blocks it (on CUDA, not under FSDP or vLLM); on = required (an error
  says what blocks it; on a CPU the steps run eagerly, which the tests use); off = transformers' generate.
- DECODE_EXPERTS (auto | mxfp4 | grouped_mm | transformers): how graph_decode computes the MoE experts. auto =
  mxfp4 (mxfp4_decode.py's Triton kernel reading the experts as MXFP4) on a GPU with Triton, else the model's own
  experts; transformers = also let transformers switch its experts to batched_mm while decoding.
- TRAIN_EXPERTS (auto | fused | transformers): the training forward's MoE elementwise work fused (fused_experts.py)
  or transformers' grouped_mm. auto = fused on a GPU with Triton.
- TRAIN_GLUE (auto | eager | compiled): the training forward's RMSNorms, rotary embedding, flex attention's sink step
  and LoRA adds (with PEFT's input cast, which autocast undoes) as compiled kernels (train_glue.py) or the libraries'
  kernel-by-kernel code. auto = compiled on a GPU with Triton; compiled on a CPU installs the same functions, run
  eagerly.
- DECODE_LORA (peft | merged): how graph_decode applies the adapter. peft = the base product, then the LoRA output
  added, as the trainer's PEFT forward computes it (the sampler samples the policy being trained); merged = the
  adapter folded into a bf16 copy of the attention weights, fewer kernels a step but rounding of its own
  (BENCHMARKS.md measures both).
- DECODE_GLUE (auto | eager | compiled): how graph_decode runs the small steps between a decode step's products
  (norms, residual adds, rotary embedding, the sink step, LoRA adds; decode_glue.py). eager = kernel by kernel, as
  the trainer's forward; compiled = fused by torch.compile on CUDA, keeping the trainer's bf16 roundings
  (BENCHMARKS.md compares the two's speed and sampler-trainer gap); auto = compiled on a GPU with Triton, else
  eager.

graph_decode attends with decode_attention.py's Triton kernel on a GPU and eagerly elsewhere, and computes the
attention projections (with the adapter's output in PEFT's order) with decode_linear.py's Triton kernel on a GPU
where they are bf16 and with F.linear elsewhere, and draws each token with draw_kernel.py's Triton kernels on a GPU
(torch.multinomial's random numbers and distribution) and with torch.multinomial elsewhere (all said on the decoding
line; no setting: each computes the training forward's arithmetic, or torch's draw). Besides these, `install`
writes flex attention's padded masks as each row's bounds, keeps transformers from switching the experts for
decoding, and on a CPU has TRL score completion positions only: library patches (tes_grpo/patches/) that only buy
speed, so they are chosen here too.
"""

from __future__ import annotations

from dataclasses import dataclass

from tes_grpo.experts.fused_experts import use_fused_experts
from tes_grpo.layers import train_glue
from tes_grpo.layers.lora import causal_lm
from tes_grpo.patches import transformers_patches, trl_patches
from tes_grpo.run.processes import process_count, uses_fsdp
from tes_grpo.run.script_config import SettingsError
from tes_grpo.sampling import decode_math, graph_decode
from tes_grpo.sampling.sampler import SamplerSpec, training_autocast
from tes_grpo.triton_support import triton_installed


def check_settings(s) -> None:
    """SettingsError for fast-path settings that contradict each other (their values are CHOICES-checked already)."""
    if s.USE_VLLM and s.DECODE_GRAPHS == "on":
        raise SettingsError("DECODE_GRAPHS=on and USE_VLLM=1 both choose how completions are generated; set one")
    for name, value in (("DECODE_EXPERTS", "mxfp4"), ("DECODE_GLUE", "compiled")):
        if s[name] == value and (s.USE_VLLM or s.DECODE_GRAPHS == "off"):
            raise SettingsError(f"{name}={value} is graph_decode's; it needs DECODE_GRAPHS=auto or on and no vLLM")


def _triton() -> bool:
    """triton_support.triton_installed, named here so that the tests can stand in for it."""
    return triton_installed()


def _no_gpu_with_triton(cuda: bool) -> str | None:
    """What keeps an `auto` setting from its Triton fast path here ("no GPU", "no triton"), or None: the one rule
    DECODE_EXPERTS, DECODE_GLUE, TRAIN_EXPERTS and TRAIN_GLUE share."""
    if not cuda:
        return "no GPU"
    return None if _triton() else "no triton"


def decode_graphs_choice(s, model, cuda: bool, sharded: bool) -> tuple[bool, str]:
    """(sample with graph_decode?, why) for DECODE_GRAPHS, the model already wrapped in LoRA. Every blocker is
    checked here, once; on with a blocker is a SettingsError naming it."""
    if s.DECODE_GRAPHS == "off":
        return False, "DECODE_GRAPHS=off"
    if s.DECODE_GRAPHS == "auto":
        if s.USE_VLLM:
            return False, "DECODE_GRAPHS=auto: off, vLLM generates"
        on, why = graph_decode.auto_decode_graphs(model, cuda, sharded)
        return on, f"DECODE_GRAPHS=auto: {why}"
    blockers = (["FSDP shards the weights (each decode step would gather them); use configs/accelerate/ddp.yaml"]
                if sharded else [])
    blockers += graph_decode.model_blockers(model) + graph_decode.state_blockers(model, training=True)
    blockers += graph_decode.graph_blockers(model) if cuda else []
    if blockers:
        raise SettingsError("DECODE_GRAPHS=on cannot sample this run: " + "; ".join(blockers)
                            + " (DECODE_GRAPHS=auto or off uses transformers' generate)")
    return True, "DECODE_GRAPHS=on" + ("" if cuda else ", no GPU: its steps run eagerly, without CUDA graphs")


def decode_experts_choice(s, cuda: bool) -> tuple[str, str]:
    """(graph_decode's experts: "mxfp4" or "model", why) for DECODE_EXPERTS, once graph_decode is on."""
    if s.DECODE_EXPERTS == "mxfp4":
        return "mxfp4", "DECODE_EXPERTS=mxfp4"
    if s.DECODE_EXPERTS != "auto":
        return "model", f"DECODE_EXPERTS={s.DECODE_EXPERTS}: the model's own experts"
    missing = _no_gpu_with_triton(cuda)
    if missing:
        return "model", f"DECODE_EXPERTS=auto: the model's own experts ({missing} for the MXFP4 kernel)"
    return "mxfp4", "DECODE_EXPERTS=auto: mxfp4 (GPU with Triton)"


def compiled_or_eager(name: str, value: str, cuda: bool) -> tuple[str, str]:
    """("eager" or "compiled", why) for a glue setting (DECODE_GLUE, TRAIN_GLUE) of this value: auto = compiled on a
    GPU with Triton."""
    if value != "auto":
        return value, f"{name}={value}"
    missing = _no_gpu_with_triton(cuda)
    if missing:
        return "eager", f"{name}=auto: eager ({missing} for torch.compile's kernels)"
    return "compiled", f"{name}=auto: compiled (GPU with Triton)"


def decode_glue_choice(s, cuda: bool) -> tuple[str, str]:
    """(graph_decode's glue: "eager" or "compiled", why) for DECODE_GLUE, once graph_decode is on."""
    return compiled_or_eager("DECODE_GLUE", s.DECODE_GLUE, cuda)


def train_experts_choice(s, cuda: bool) -> tuple[bool, str]:
    """(fuse the training forward's MoE elementwise work?, why) for TRAIN_EXPERTS. "fused" on a CPU runs the same
    functions eagerly."""
    if s.TRAIN_EXPERTS != "auto":
        return s.TRAIN_EXPERTS == "fused", f"TRAIN_EXPERTS={s.TRAIN_EXPERTS}"
    missing = _no_gpu_with_triton(cuda)
    if missing:
        return False, f"TRAIN_EXPERTS=auto: {missing} for torch.compile's kernels"
    return True, "TRAIN_EXPERTS=auto: GPU with Triton"


def train_glue_choice(s, cuda: bool) -> tuple[str, str]:
    """(the training forward's glue: "eager", the libraries' own code, or "compiled", train_glue.py's, why) for
    TRAIN_GLUE."""
    return compiled_or_eager("TRAIN_GLUE", s.TRAIN_GLUE, cuda)


@dataclass(frozen=True)
class FastPaths:
    """A run's choices (see `choose`): the sampler to build, whether the training experts are fused, how the training
    forward's glue runs, the speed patches to apply, and the log lines saying what was chosen and why."""

    sampler: SamplerSpec
    fused_training_experts: bool
    training_experts_why: str
    train_glue: str
    train_glue_why: str
    device_type: str
    keep_grouped_mm_for_decode: bool
    flex_masks_from_bounds: bool
    cpu_completion_scoring: bool
    reasons: tuple[str, ...]


def choose(s, trainer, cuda: bool, generation_sequences: int | None = None) -> FastPaths:
    """The fast paths of a run on a GRPOTrainer (its model already LoRA-wrapped, FSDP decided), each decided once.
    generation_sequences: the most sequences a generate call may take (memory_plan's plan; None = the whole
    generation batch); only graph_decode can split a batch, so a split without it is a SettingsError."""
    model, sharded = trainer.model, trainer.is_fsdp_enabled
    reasons = []
    if uses_fsdp() and not sharded:
        reasons.append("note: the FSDP config has no effect without GPUs; accelerate runs plain data parallelism here")
    graphs, why = decode_graphs_choice(s, model, cuda, sharded)
    experts, experts_why = decode_experts_choice(s, cuda) if graphs else ("model", "")
    glue, glue_why = decode_glue_choice(s, cuda) if graphs else ("eager", "")
    batch = trainer.args.per_device_train_batch_size * trainer.args.steps_per_generation
    split = generation_sequences is not None and generation_sequences < batch
    if split and not graphs:
        raise SettingsError(f"memory: a generate call fits {generation_sequences} of the {batch} sequences of a "
                            f"generation batch, and only graph_decode splits a batch ({why}); use DECODE_GRAPHS=auto "
                            "or lower MAX_COMPLETION_LEN")
    backend = "vllm" if s.USE_VLLM else "graph_decode" if graphs else "generate"
    autocast = training_autocast(trainer)
    blocker = decode_math.projection_kernel_blocker("cuda" if cuda else "cpu", autocast)
    spec = SamplerSpec(backend, experts=experts, lora=s.DECODE_LORA, glue=glue,
                       max_batch=generation_sequences if split else None,
                       autocast=autocast, synced=sharded and process_count() > 1)
    label = {"graph_decode": "graph_decode.py, static KV cache", "generate": "transformers generate",
             "vllm": "vLLM, colocated"}[backend]
    reasons.append(f"decoding: {label} ({why}"
                   + (f"; experts: {experts_why}; LoRA: DECODE_LORA={s.DECODE_LORA}; glue: {glue_why}; attention: "
                      + ("decode_attention.py's kernel (GPU)" if cuda else "eager (no GPU)") + "; projections: "
                      + ("F.linear (merged weights)" if s.DECODE_LORA == "merged"
                         else f"F.linear ({blocker})" if blocker is not None
                         else "decode_linear.py's kernel (GPU; each layer whose weights and adapter are bf16)")
                      + "; draws: " + ("draw_kernel.py's kernels (GPU)" if cuda else "torch.multinomial (no GPU)")
                      if graphs else "; DECODE_GLUE=compiled unused: it is graph_decode's"
                      if s.DECODE_GLUE == "compiled" else "")
                   + (f"; {generation_sequences} of the {batch} sequences a call, as memory allows" if split else "")
                   + ")")
    fused, fused_why = train_experts_choice(s, cuda)
    inner = causal_lm(model)
    if not fused:
        reasons.append(f"training experts: transformers' {inner.config._experts_implementation} ({fused_why})")
    training_glue, training_glue_why = train_glue_choice(s, cuda)
    if training_glue == "eager":
        reasons.append(f"training glue: the libraries' own, kernel by kernel ({training_glue_why})")
    return FastPaths(sampler=spec, fused_training_experts=fused, training_experts_why=fused_why,
                     train_glue=training_glue, train_glue_why=training_glue_why, device_type="cuda" if cuda else "cpu",
                     keep_grouped_mm_for_decode=s.DECODE_EXPERTS != "transformers",
                     flex_masks_from_bounds=inner.config._attn_implementation == "flex_attention",
                     cpu_completion_scoring=not cuda, reasons=tuple(reasons))


def install(trainer, paths: FastPaths) -> list[str]:
    """Applies `paths`' training-side choices and speed patches to a GRPOTrainer (the trainer builds the sampler);
    returns the log lines: the choices' reasons, then what each install did."""
    lines = list(paths.reasons)
    model = trainer.model
    if paths.keep_grouped_mm_for_decode and transformers_patches.keep_grouped_mm_experts_for_decode(causal_lm(model),
                                                                                                   lines.append):
        lines.append("decoding experts: the model's own experts stay on grouped_mm while generating (transformers "
                     "would switch them to batched_mm; they run the prefill and any layer the MXFP4 kernel does not "
                     "take; DECODE_EXPERTS)")
    if paths.cpu_completion_scoring:
        trl_patches.score_only_completion_tokens_on_cpu(lines.append)
    if paths.flex_masks_from_bounds and transformers_patches.flex_masks_with_padding_bounds(lines.append):
        lines.append("flex attention: padded masks written as each row's bounds (patches/transformers_patches.py)")
    if paths.fused_training_experts:
        layers = use_fused_experts(model, say=lines.append)
        lines.append(f"training experts: {layers} layer(s) fused ({paths.training_experts_why}; fused_experts.py: "
                     "bias + SwiGLU and bias + routing weight + top-k sum as one compiled kernel each, forward and "
                     "backward)")
    if paths.train_glue == "compiled":
        glue = train_glue.decide(paths.device_type, "compiled")
        norms, projections = train_glue.use_train_glue(model, glue)
        rotary = train_glue.rope_through(glue, lines.append)
        # the wrapper acts only where flex attention returns its log-sum-exp: on CUDA
        sinks = (paths.flex_masks_from_bounds and paths.device_type == "cuda"
                 and train_glue.sinks_through(glue, lines.append))
        lines.append(f"training glue: {norms} norms, {projections} LoRA projections"
                     + (", the rotary embedding" if rotary else "") + (", flex attention's sink step" if sinks else "")
                     + f" {glue.how} ({paths.train_glue_why}; train_glue.py)")
    return lines
