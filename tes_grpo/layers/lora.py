"""LoRA's parts as PEFT 0.21's lora.Linear computes them, for code that computes a LoRA projection itself: the
decode step (sampling/decode_math.py, sampling/decode_linear.py) and the training forward's glue
(layers/train_glue.py). `lora_parts` reads (weight, bias, (A, B, scaling)) off a layer where its forward is plain
LoRA; `low_rank` batches the adapters of projections that share an input; `merged_linear` folds the adapter into a
copy of the weight (DECODE_LORA=merged); `causal_lm` is the model under the LoRA wrapper."""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch


def causal_lm(model):
    """The causal LM under PEFT's LoRA wrapper (the one whose generate() and forward run, and which TRL patches), or
    the model itself when it is not wrapped."""
    return model.get_base_model() if hasattr(model, "get_base_model") else model


@dataclass(frozen=True)
class LowRank:
    """The LoRA part of one or more projections that read the same input (q, k and v), computed as PEFT 0.21's
    lora.Linear.forward computes it, in one product per factor for all of them.

    PEFT adds `lora_B(lora_A(x)) * scaling` to the base layer's output. The factors here are its A and B in the
    dtype that forward computes in: the training autocast's dtype when the trainer runs under autocast (bf16 on GPUs:
    autocast casts x, A and B to bf16 and every product comes out in bf16), else A's dtype (PEFT casts x to it).
    a: the projections' A stacked [sum of ranks, in]; b: their B as one block-diagonal matrix [sum of outputs, sum of
    ranks] (the zero blocks add exact zeros); scale: the scaling, multiplied after b as PEFT does, or None when it is
    a power of two and folded into b (exact in any float dtype: the same numbers as multiplying after); splits: the
    output features of each projection. Why batched: unbatched, each LoRA projection adds a few small kernels to
    every decode step, for each of gpt-oss's attention projections; batched, q, k and v share two products and no
    cast kernels are left (BENCHMARKS.md counts them).
    """

    a: torch.Tensor
    b: torch.Tensor
    scale: float | None
    splits: tuple[int, ...]

    def __call__(self, x: torch.Tensor) -> tuple[torch.Tensor, ...]:
        y = torch.nn.functional.linear(torch.nn.functional.linear(x.to(self.a.dtype), self.a), self.b)
        if self.scale is not None:
            y = y * self.scale
        return y.split(self.splits, dim=-1)


def _power_of_two(value: float) -> bool:
    return value > 0 and math.frexp(value)[0] == 0.5


def low_rank(factors: list[tuple[torch.Tensor, torch.Tensor, float]], dtype: torch.dtype) -> LowRank:
    """LowRank for (A, B, scaling) of projections sharing an input (all with the same scaling), in `dtype`."""
    scale = factors[0][2]
    a = torch.cat([A.detach() for A, _, _ in factors]).to(dtype)
    b = torch.block_diag(*[B.detach() for _, B, _ in factors]).to(dtype)
    folded = _power_of_two(scale)
    return LowRank(a=a, b=b * scale if folded else b, scale=None if folded else scale,
                   splits=tuple(B.shape[0] for _, B, _ in factors))


def lora_parts(module):
    """(weight, bias, lora) that compute module(x) in PEFT's order: the base layer's F.linear(x, weight, bias), then,
    when lora = (A, B, scaling) is not None, + B(A(x)) * scaling (see LowRank). An nn.Linear gives its own tensors and
    no lora. None (call the module) for anything else: other layer types, several active adapters, LoRA variants
    (DoRA), LoRA biases, dropout left on, input casting switched off, or adapters disabled over merged weights (PEFT
    would unmerge them). Branch for branch as PEFT 0.21's lora.Linear.forward: adapters disabled -> the base layer;
    merged -> the base layer (which holds the delta); else each active adapter's product added.
    """
    if type(module) is torch.nn.Linear:
        return module.weight, module.bias, None
    base = getattr(module, "base_layer", None)
    if type(base) is not torch.nn.Linear or not hasattr(module, "lora_A"):
        return None
    if module.disable_adapters:
        return None if module.merged else (base.weight, base.bias, None)
    if module.merged:
        return base.weight, base.bias, None
    active = [a for a in module.active_adapters if a in module.lora_A]
    if not active:
        return base.weight, base.bias, None
    name = active[0]
    dropout = module.lora_dropout[name]
    if (len(active) > 1 or name in getattr(module, "lora_variant", {}) or module.use_dora.get(name)
            or getattr(module, "lora_bias", {}).get(name) or not getattr(module, "cast_input_dtype_enabled", True)
            or (isinstance(dropout, torch.nn.Dropout) and dropout.p > 0 and dropout.training)):
        return None
    return base.weight, base.bias, (module.lora_A[name].weight, module.lora_B[name].weight, module.scaling[name])


def merged_linear(module) -> tuple[torch.Tensor, torch.Tensor | None] | None:
    """LORA="merged" (kept to compare with): (weight, bias) with each active adapter's delta (PEFT 0.21's
    lora.Linear.get_delta_weight, scaling included) added to the base weight in float32 and rounded once to the
    weight's dtype, for F.linear: a new tensor, the model is untouched. None (call the module) where lora_parts gives
    None.

    What it costs in fidelity: the merged copy's rounding errors are independent of the trainer's, which rounds the
    base product and adds the LoRA output to it (BENCHMARKS.md, "Measured on the CPU", compares the two orders).
    """
    parts = lora_parts(module)
    if parts is None:
        return None
    weight, bias, lora = parts
    if lora is None:
        return weight, bias
    A, B, scaling = lora
    return (weight.float() + (B.float() @ A.float()) * scaling).to(weight.dtype), bias
