"""Which fast paths a GRPO run takes, decided once, and installed on the trainer: the one place that chooses kernels.

train_grpo.py calls `check_settings(s)` with its other setting checks (before anything slow) and, once the trainer
has wrapped the model in LoRA, `install(trainer, s, cuda)`, which returns the lines the log prints. The choices:

- DECODE_GRAPHS (auto | on | off): sample with graph_decode.py (static KV cache, each decode step replayed as a
  CUDA graph) instead of transformers' generate. auto = on when graph_decode.auto_decode_graphs finds nothing in
  this model, machine or parallel setup that blocks it (on CUDA, not under FSDP or vLLM); on = required (an error
  says what blocks it; on a CPU the steps run eagerly, which the tests use); off = transformers' generate.
- DECODE_EXPERTS (auto | mxfp4 | grouped_mm | transformers): how graph_decode computes the MoE experts. auto =
  mxfp4 (mxfp4_decode.py's Triton kernel reading the experts as MXFP4) on a GPU with Triton, else the model's own
  experts; transformers = also let transformers switch its experts to batched_mm while decoding.
- TRAIN_EXPERTS (auto | fused | transformers): the training forward's MoE elementwise work fused (fused_experts.py)
  or transformers' grouped_mm. auto = fused on a GPU with Triton.
- DECODE_LORA (peft | merged): how graph_decode applies the adapter. peft = the base product, then the LoRA output
  added, as the trainer's PEFT forward computes it (the sampler samples the policy being trained); merged = the
  adapter folded into a bf16 copy of the attention weights, fewer kernels a step but rounding of its own
  (BENCHMARKS.md, "MXFP4-resident experts, sampler fidelity and gpt-oss-120b", measures both).

The library workarounds the run needs are installed here too, each from tes_grpo/workarounds.py, in this order:
experts kept for decoding, CPU scoring of completion positions only, flex attention masks from padding bounds,
quiet all-rewards-None warnings, generate() kept in step across FSDP processes, then the sampler, the training
experts, and real storage for trainable weights left on the meta device.
"""

from __future__ import annotations

import importlib.util

from tes_grpo import workarounds
from tes_grpo.script_config import SettingsError

CHOICES = {
    "DECODE_GRAPHS": ("auto", "on", "off"),
    "DECODE_EXPERTS": ("auto", "mxfp4", "grouped_mm", "transformers"),
    "TRAIN_EXPERTS": ("auto", "fused", "transformers"),
    "DECODE_LORA": ("peft", "merged"),
}


def check_settings(s) -> None:
    """SettingsError for fast-path settings that contradict each other (their values are CHOICES-checked already)."""
    if s.USE_VLLM and s.DECODE_GRAPHS == "on":
        raise SettingsError("DECODE_GRAPHS=on and USE_VLLM=1 both choose how completions are generated; set one")
    if s.DECODE_EXPERTS == "mxfp4" and (s.USE_VLLM or s.DECODE_GRAPHS == "off"):
        raise SettingsError("DECODE_EXPERTS=mxfp4 is graph_decode's; it needs DECODE_GRAPHS=auto or on and no vLLM")


def _triton() -> bool:
    return importlib.util.find_spec("triton") is not None


def decode_graphs_choice(s, model, cuda: bool, sharded: bool) -> tuple[bool, str]:
    """(sample with graph_decode?, why) for DECODE_GRAPHS, the model already wrapped in LoRA. Every blocker is
    checked here, once; on with a blocker is a SettingsError naming it."""
    from tes_grpo import graph_decode

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
    if not cuda:
        return "model", "DECODE_EXPERTS=auto: the model's own experts (no GPU for the MXFP4 kernel)"
    if not _triton():
        return "model", "DECODE_EXPERTS=auto: the model's own experts (no triton for the MXFP4 kernel)"
    return "mxfp4", "DECODE_EXPERTS=auto: mxfp4 (GPU with Triton)"


def train_experts_choice(s, cuda: bool) -> tuple[bool, str]:
    """(fuse the training forward's MoE elementwise work?, why) for TRAIN_EXPERTS. "fused" on a CPU runs the same
    functions eagerly."""
    if s.TRAIN_EXPERTS != "auto":
        return s.TRAIN_EXPERTS == "fused", f"TRAIN_EXPERTS={s.TRAIN_EXPERTS}"
    if not cuda:
        return False, "TRAIN_EXPERTS=auto: no GPU"
    if not _triton():
        return False, "TRAIN_EXPERTS=auto: no triton for torch.compile's kernels"
    return True, "TRAIN_EXPERTS=auto: GPU with Triton"


def use_graph_decode(model, experts: str, say, max_batch: int | None = None, lora: str = "peft") -> None:
    """Routes the model's generate() through graph_decode.GraphDecodeGenerate (idempotent; the latest choices win):
    experts as decode_experts_choice chose, at most max_batch rows a call (None: the whole batch at once), the
    adapter applied as `lora` says (DECODE_LORA)."""
    from tes_grpo.graph_decode import GraphDecodeGenerate, causal_lm

    inner = causal_lm(model)
    if not isinstance(inner.generate, GraphDecodeGenerate):
        inner.generate = GraphDecodeGenerate(inner, inner.generate, say=say)
    inner.generate.experts = experts
    inner.generate.max_batch = max_batch
    inner.generate.lora = lora


def install(trainer, s, cuda: bool, processes: int = 1, generation_sequences: int | None = None) -> list[str]:
    """Installs the run's workarounds and fast paths on a GRPOTrainer (its model already LoRA-wrapped); returns the
    log lines saying what was chosen and why. generation_sequences: the most sequences a generate call may take
    (memory_plan's plan; None = the whole generation batch); only graph_decode can split a batch."""
    from tes_grpo.processes import say, uses_fsdp

    lines: list[str] = []
    model = trainer.model
    inner = model.get_base_model() if hasattr(model, "get_base_model") else model
    if s.DECODE_EXPERTS != "transformers" and workarounds.keep_grouped_mm_experts_for_decode(model, lines.append):
        lines.append("decoding experts: grouped_mm kept for decoding (DECODE_EXPERTS)")
    if not cuda:
        workarounds.score_only_completion_tokens_on_cpu(lines.append)
    if inner.config._attn_implementation == "flex_attention" and workarounds.flex_masks_with_padding_bounds(
            lines.append):
        lines.append("flex attention: padded masks written as each row's bounds (workarounds.py)")
    workarounds.quiet_all_rewards_none_warning()
    sharded = trainer.is_fsdp_enabled
    if uses_fsdp() and not sharded:
        lines.append("note: the FSDP config has no effect without GPUs; accelerate runs plain data parallelism here")
    workarounds.sync_generation_across_processes(model, sharded, processes, lines.append)

    graphs, why = decode_graphs_choice(s, model, cuda, sharded)
    experts, experts_why = decode_experts_choice(s, cuda) if graphs else ("model", "")
    batch = trainer.args.per_device_train_batch_size * trainer.args.steps_per_generation
    split = generation_sequences is not None and generation_sequences < batch
    if split and not graphs:
        raise SettingsError(f"memory: a generate call fits {generation_sequences} of the {batch} sequences of a "
                            f"generation batch, and only graph_decode splits a batch ({why}); use DECODE_GRAPHS=auto "
                            "or lower MAX_COMPLETION_LEN")
    if graphs:
        use_graph_decode(model, experts, say, generation_sequences if split else None, s.DECODE_LORA)
    lines.append(f"decoding: {'graph_decode.py, static KV cache' if graphs else 'transformers generate'} ({why}"
                 + (f"; experts: {experts_why}; LoRA: DECODE_LORA={s.DECODE_LORA}" if graphs else "")
                 + (f"; {generation_sequences} of the {batch} sequences a call, as memory allows" if split else "")
                 + ")")
    fused, why = train_experts_choice(s, cuda)
    if fused:
        from tes_grpo.fused_experts import use_fused_experts

        layers = use_fused_experts(model, say=lines.append)
        lines.append(f"training experts: {layers} layer(s) fused ({why}; fused_experts.py: bias + SwiGLU and bias + "
                     "routing weight + top-k sum as one compiled kernel each, forward and backward)")
    else:
        lines.append(f"training experts: transformers' {inner.config._experts_implementation} ({why})")
    workarounds.give_trainable_weights_storage(model)
    return lines
