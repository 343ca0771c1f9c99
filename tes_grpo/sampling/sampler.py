"""The trainer's sampler: how GRPO's completions are generated, assembled in one place (`install`).

fast_paths.choose decides a SamplerSpec once per run; `install` builds the sampler it names on a GRPOTrainer,
each part given everything at construction, from the inside out:

1. the backend: transformers' generate (the model's own), graph_decode's GraphDecodeGenerate (which hands a call it
   cannot take to 1's generate), or vLLM (TRL's colocated engine: the model's generate() is then not called);
2. under FSDP, SyncedGenerate: every process keeps stepping until all are done;
3. RecordingGenerate: each call's sampled log-probabilities, which the trainer hook of sampling_fidelity.py
   compares with the trainer's every step (vLLM returns them itself);
and under vLLM, BaseWeightsKept on TRL's weight sync, so the frozen base weights stay as they are.
SyncedGenerate and BaseWeightsKept wrap library calls: tes_grpo/patches/registry.py lists them with the versions
they were checked on.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from peft.tuners.tuners_utils import BaseTunerLayer
from transformers import LogitsProcessorList

from tes_grpo.sampling import sampling_fidelity
from tes_grpo.sampling.graph_decode import GraphDecodeGenerate
from tes_grpo.sampling.token_sampling import SampledLogprobs, logits_warpers, recording_blockers
from tes_grpo.training.lm_head import causal_lm

BACKENDS = ("graph_decode", "generate", "vllm")


@dataclass(frozen=True)
class SamplerSpec:
    """What `install` builds: backend (one of BACKENDS); for graph_decode, its experts ("model" or "mxfp4"), lora
    ("peft" or "merged"), glue ("eager" or "compiled": decode_glue) and max_batch (rows a generate call takes at
    most; None = the whole batch); autocast: the dtype the trainer's forward runs under autocast in (graph_decode
    decodes under it; None = none); synced: FSDP shards the weights over several processes, which must step
    together."""

    backend: str
    experts: str = "model"
    lora: str = "peft"
    glue: str = "eager"
    max_batch: int | None = None
    autocast: torch.dtype | None = None
    synced: bool = False

    def __post_init__(self):
        if self.backend not in BACKENDS:
            raise ValueError(f"SamplerSpec: backend must be one of {BACKENDS}, got {self.backend!r}")


def training_autocast(trainer) -> torch.dtype | None:
    """The dtype the trainer's forward runs under autocast in (accelerate's mixed precision), or None."""
    return {"bf16": torch.bfloat16, "fp16": torch.float16}.get(str(trainer.accelerator.mixed_precision))


def install(trainer, spec: SamplerSpec, correction: sampling_fidelity.Correction | None = None, say=print):
    """Builds the sampler `spec` names on a GRPOTrainer (its model LoRA-wrapped) and hooks the sampler-trainer
    measurement (and `correction`) into it; returns the sampling_fidelity.FidelityHook, also kept as
    trainer.sampling_fidelity (correction None: IMPORTANCE_SAMPLING off). The parts, from the inside out, as the
    module docstring lists them."""
    correction = correction or sampling_fidelity.Correction()
    sampling_fidelity.check_trainer(trainer, say)  # before anything is wrapped
    if (spec.backend == "vllm") != bool(getattr(trainer, "use_vllm", False)):
        raise ValueError(f"sampler: backend {spec.backend!r}, but the trainer's use_vllm is "
                         f"{getattr(trainer, 'use_vllm', False)} (USE_VLLM and the trainer's config disagree)")
    recording = None
    if spec.backend == "vllm":
        guard_base_weights(trainer, say)
    else:
        lm = causal_lm(trainer.model)
        generate = lm.generate
        if spec.synced:
            generate = SyncedGenerate(generate)
            say("FSDP: generate() runs with synced_gpus=True (processes step together until all completions end)")
        if spec.backend == "graph_decode":
            generate = GraphDecodeGenerate(lm, generate, experts=spec.experts, lora=spec.lora,
                                           autocast=spec.autocast, max_batch=spec.max_batch, say=say,
                                           glue=spec.glue)
        recording = RecordingGenerate(lm, generate, say=say)
        lm.generate = recording
    hook = sampling_fidelity.hook_trainer(trainer, correction, recording, say)
    say("sampling metrics: the sampler's log-probabilities against the trainer's every step (sampling/*, "
        + ("vLLM's" if spec.backend == "vllm" else "recorded while generating")
        + f"); IMPORTANCE_SAMPLING={correction.mode}" + (f" (cap {correction.cap})" if correction.on else "")
        + (f"; graph_decode decodes under the trainer's autocast ({spec.autocast})"
           if spec.backend == "graph_decode" and spec.autocast else ""))
    return hook


class SyncedGenerate:
    """transformers 5.17-5.24 + accelerate 1.x FSDP2: wraps a model's generate() to pass synced_gpus=True, so that
    every process keeps stepping until all are done.

    Under FSDP every process must run the same number of forward passes (each gathers the sharded weights), so a
    process whose completions all ended keeps stepping until every process is done. transformers sets synced_gpus
    itself only for its own FSDP integration, not for accelerate's.
    """

    def __init__(self, generate):
        self.generate = generate

    def __call__(self, *args, **kwargs):
        kwargs.setdefault("synced_gpus", True)
        return self.generate(*args, **kwargs)


class RecordingGenerate:
    """Wraps a model's generate() (transformers' own, GraphDecodeGenerate or SyncedGenerate) to keep the sampled
    tokens' log-probabilities of its latest call (`take`), through a SampledLogprobs logits processor. Returns what
    the wrapped generate returns."""

    def __init__(self, model, generate, say=print):
        self.model, self.generate, self.say = model, generate, say
        self.latest: torch.Tensor | None = None
        self.reported: set[str] = set()

    def __call__(self, *args, **kwargs):
        self.latest = None
        input_ids = kwargs.get("input_ids", args[0] if args else None)
        config = kwargs.get("generation_config") or self.model.generation_config
        blockers = recording_blockers(config) + ([] if input_ids is not None else ["no input_ids"])
        if blockers:
            text = ", ".join(blockers)
            if text not in self.reported:
                self.reported.add(text)
                self.say(f"sampling metrics: not recorded for this generate call ({text})")
            return self.generate(*args, **kwargs)
        recorder = SampledLogprobs(logits_warpers(config))
        processors = LogitsProcessorList(kwargs.pop("logits_processor", None) or [])
        processors.append(recorder)
        out = self.generate(*args, logits_processor=processors, **kwargs)
        sequences = out if isinstance(out, torch.Tensor) else out.sequences
        self.latest = recorder.result(sequences, input_ids.shape[1])
        return out

    def take(self) -> torch.Tensor | None:
        """The latest call's log-probabilities [B, n] (None if it recorded none), handed out once."""
        latest, self.latest = self.latest, None
        return latest


def adapter_base_parameters(model) -> list:
    """The frozen parameters of every PEFT adapter layer's base layer (what PEFT's merge_adapter writes into):
    nn.Linear weights and biases under LoRA, the experts' tensors under target_parameters."""
    found = {}
    for module in model.modules():
        if isinstance(module, BaseTunerLayer):
            for param in module.get_base_layer().parameters(recurse=False):
                if not param.requires_grad:
                    found[id(param)] = param
    return list(found.values())


class BaseWeightsKept:
    """TRL 1.16: wraps TRL's VLLMGeneration.sync_weights: the adapter layers' base weights are copied before the sync
    and written back after it (see guard_base_weights). The copies live on the CPU (pinned when the weights are on a
    GPU, so the copies are fast) and are kept between syncs."""

    def __init__(self, sync, model):
        self.sync, self.model = sync, model
        self.saved: list | None = None

    def __call__(self, *args, **kwargs):
        if self.saved is None:
            params = adapter_base_parameters(self.model)
            self.saved = [(p, torch.empty(p.shape, dtype=p.dtype, device="cpu", pin_memory=p.is_cuda))
                          for p in params]
        with torch.no_grad():
            for param, copy in self.saved:
                copy.copy_(param.detach())
        try:
            return self.sync(*args, **kwargs)
        finally:
            with torch.no_grad():
                for param, copy in self.saved:
                    param.data.copy_(copy)


def guard_base_weights(trainer, say=print) -> bool:
    """TRL 1.16 (trl/generation/vllm_generation.py, VLLMGeneration._iter_named_params): keeps the frozen base weights
    bit for bit across every weight sync to vLLM.

    To send vLLM the adapted weights, TRL calls PEFT's merge_adapter() (W += delta, in place, in the trainer's own
    bf16 base weights), reads them, then unmerge_adapter() (W -= delta). In bf16, W + delta - delta is not W: each
    sync moves some base elements by an ulp, and the frozen base, the policy's starting point, drifts a little more
    every step (tests/test_sampling_fidelity.py measures it). Here the adapter layers' base weights are copied
    before each sync and written back after it, so vLLM still gets the merged weights and the trainer's base never
    changes. Costs a copy of those weights (the attention projections') to pinned CPU memory and back per sync.
    Returns False (and says so) when the trainer has no vLLM weight sync to wrap.
    """
    generation = getattr(trainer, "vllm_generation", None)
    sync = getattr(generation, "sync_weights", None)
    if sync is None:
        say("note: this trainer has no vllm_generation.sync_weights; base weights are not guarded across syncs")
        return False
    if not isinstance(sync, BaseWeightsKept):
        generation.sync_weights = BaseWeightsKept(sync, trainer.model)
    say("vLLM: the base weights are copied before each weight sync and restored after it (TRL merges the adapter "
        "into them in place; sampler.py)")
    return True
