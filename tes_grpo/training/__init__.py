"""Training with GRPO on one GPU (or several): the trainer, which fast paths a run takes, the LM head, memory and
the batch layout.

- trainer: TRL's GRPOTrainer with the project's sampler, the sampler-trainer gap and the fast paths, given at
  construction
- fast_paths: which sampler and kernels a run takes, decided once
- lm_head: TRL's fused LM head, which never builds a micro-batch's logits
- memory_estimate: the bytes a run needs: weights, a training pass, a generate call, each GPU's share under FSDP2
- memory_plan: completions a training pass and sequences a generate call from the GPU's memory
- batch_layout: how an optimizer step's completions are generated and split into forward/backward passes
"""
