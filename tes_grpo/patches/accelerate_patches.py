"""Patches for accelerate's FSDP2 preparation, with the versions they were checked on and why."""

from __future__ import annotations

import torch


def give_trainable_weights_storage(model) -> int:
    """accelerate 1.10-1.15 FSDP2: gives trainable parameters left on the meta device real (uninitialised) CPU
    storage.

    On FSDP ranks > 0 the base model is built without weights (meta) and PEFT adds its LoRA weights there too.
    accelerate maps the optimizer's parameters to their sharded copies by data_ptr(), which is 0 for every meta
    tensor: left on meta, all LoRA weights would map to one tensor and never be trained on that rank. FSDP
    overwrites the storage with rank 0's values while sharding. The frozen base weights stay on meta. Returns how
    many parameters moved.
    """
    moved = 0
    for module in model.modules():
        for name, param in list(module.named_parameters(recurse=False)):
            if param.requires_grad and param.is_meta:
                setattr(module, name, torch.nn.Parameter(torch.empty_like(param, device="cpu"), requires_grad=True))
                moved += 1
    return moved
