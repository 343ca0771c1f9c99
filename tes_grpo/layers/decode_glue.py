"""The decode step's glue: the small steps between its matrix products, as pure functions of tensors, and where they
run compiled (used by decode_math.py).

A decode step of gpt-oss is mostly matrix products, attention and the experts; between them sit short chains of
elementwise steps and small reductions, each its own kernel when run eagerly: the residual add and the RMSNorm after
it (`residual_norm`, `rms_norm`: GptOssRMSNorm's float32 casts), the rotary embedding of the query and the key
(`rope_qk`: transformers' apply_rotary_pos_emb), the renormalisation of flex attention's output for gpt-oss's sinks
(`with_sinks`: transformers' flex attention's step) and the LoRA adapter's output added to the base products
(`add_lora`: PEFT's add). Each computes what the trainer's forward computes, rounding for rounding: the sampler must
sample the policy the trainer computes (graph_decode.py's docstring says why), so every bf16 rounding of the
trainer's forward is kept. The functions take tensors and numbers only, no modules, so one compiled function serves
every layer.

`glue_for(device, mode)` decides, once per process for a device type and mode, how they run, and says it. Mode
"eager": kernel by kernel, as the trainer's forward runs them. Mode "compiled": on CUDA through torch.compile
(fullgraph, fixed shapes) with inductor's `emulate_precision_casts`, which keeps the bf16 roundings of the eager code
where it would otherwise keep fused intermediates in float32; eagerly elsewhere, or where inductor lacks that option
(said). Compiled, the sink step runs compiled only under autocast (where its log-sum-exp
takes float32 inputs, as the trainer's does): without autocast inductor's log-sum-exp of bf16 inputs rounds other
than eager's, so it stays eager there. BENCHMARKS.md compares the two modes. A `Glue` carries the choice through a
decode step; decode_cache's DecodeGraphs runs a warm-up step before each capture, so the first (compiling) call is
never inside a capture. Compiled results can differ from eager ones only where a float32 reduction or a float32
exp/log is computed by another kernel (the RMSNorm's mean, the sinks' log-sum-exp): by a float32 rounding before the
bf16 one, which moves a bf16 result by one unit in the last place on a few elements (tests/gpu_cuda_test.py).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
from transformers.models.gpt_oss.modeling_gpt_oss import GptOssRMSNorm, apply_rotary_pos_emb

GLUE_MODES = ("eager", "compiled")  # eager: kernel by kernel; compiled: through inductor on CUDA, eager elsewhere


def rms_norm(hidden: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """GptOssRMSNorm.forward (transformers 5.17-5.24) as a function of its weight and epsilon, cast for cast: the hidden
    states in float32, times rsqrt(mean of squares + eps), times the weight (float32 by promotion), rounded to the
    input's dtype."""
    input_dtype = hidden.dtype
    hidden = hidden.to(torch.float32)
    variance = hidden.pow(2).mean(-1, keepdim=True)
    hidden = hidden * torch.rsqrt(variance + eps)
    return (weight * hidden).to(input_dtype)


def residual_norm(residual: torch.Tensor, delta: torch.Tensor, weight: torch.Tensor,
                  eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    """(hidden, normed): hidden = residual + delta (a decoder layer's residual add, in the residual's dtype, as
    transformers 5.17-5.24's GptOssDecoderLayer.forward adds), normed = rms_norm of it (the next norm: the layer's
    post-attention norm, the next layer's input norm or the final norm)."""
    hidden = residual + delta
    return hidden, rms_norm(hidden, weight, eps)


def rope_qk(query: torch.Tensor, key: torch.Tensor, cos: torch.Tensor,
            sin: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The rotary embedding of query [B, H, 1, D] and key [B, KV, 1, D]: transformers 5.17-5.24's
    apply_rotary_pos_emb itself (cos, sin as gpt-oss's rotary embedding gives them, in the hidden states' dtype)."""
    return apply_rotary_pos_emb(query, key, cos, sin)


def with_sinks(out: torch.Tensor, lse: torch.Tensor, sinks: torch.Tensor) -> torch.Tensor:
    """Flex attention's output renormalised for gpt-oss's sinks op for op as transformers 5.17-5.24's flex attention
    does it in the training forward (integrations/flex_attention.py: the log-sum-exp rounded to the values' dtype,
    logsumexp with the sink, out * exp(lse - combined), under the caller's autocast), so the decode step rounds where
    the trainer rounds: bf16's log-sum-exp is off by up to 1/16 at 8 to 16, which moves the sink's share of each
    head by up to ~1.5 % (a float32 sigmoid(lse - sink) here would not). out [B, H, Q, D], lse [B, H, Q]."""
    lse = lse.to(out.dtype).unsqueeze(-1)
    batch, heads, queries, _ = out.shape
    sink = sinks.view(1, -1, 1, 1).expand(batch, heads, queries, 1)
    combined = torch.logsumexp(torch.cat([lse, sink], dim=-1), dim=-1, keepdim=True)
    return (out * torch.exp(lse - combined)).to(out.dtype)


def add_lora(outputs: list[torch.Tensor], extras: list[torch.Tensor]) -> list[torch.Tensor]:
    """PEFT 0.21's lora.Linear.forward's `result = (result + lora_B(lora_A(x)) * scaling).to(result.dtype)` for
    each base output and its adapter output (lora.py's LowRank computes the latter)."""
    return [(out + extra).to(out.dtype) for out, extra in zip(outputs, extras, strict=True)]


def norm_weights(module) -> tuple[torch.Tensor, float] | None:
    """(weight, eps) of a norm that rms_norm computes exactly: a GptOssRMSNorm running its class's forward with no
    hooks, or train_glue's variant of it (glue_class), which computes rms_norm too. None for anything else (another
    class, a forward replaced on the instance as a hub kernel would, or forward hooks, which only a module call
    runs): call the module."""
    computes = type(module) is GptOssRMSNorm or getattr(type(module), "computes_rms_norm", False)
    if not computes or "forward" in vars(module):
        return None
    if module._forward_hooks or module._forward_pre_hooks:
        return None
    return module.weight, module.variance_epsilon


@dataclass(frozen=True)
class Glue:
    """The glue functions a decode step calls (each with the signature of its namesake above), and `how`: one line
    saying how they run (eagerly or compiled, and why)."""

    rms_norm: Callable
    residual_norm: Callable
    rope_qk: Callable
    with_sinks: Callable
    add_lora: Callable
    how: str

    def norm(self, hidden: torch.Tensor, module) -> torch.Tensor:
        """module(hidden) for a decoder norm (rms_norm where norm_weights takes it)."""
        weights = norm_weights(module)
        return module(hidden) if weights is None else self.rms_norm(hidden, *weights)

    def add_norm(self, residual: torch.Tensor, delta: torch.Tensor, module) -> tuple[torch.Tensor, torch.Tensor]:
        """(residual + delta, module(residual + delta)) (residual_norm where norm_weights takes the module)."""
        weights = norm_weights(module)
        if weights is None:
            hidden = residual + delta
            return hidden, module(hidden)
        return self.residual_norm(residual, delta, *weights)


_FUNCTIONS = (rms_norm, residual_norm, rope_qk, with_sinks, add_lora)
EAGER = Glue(*_FUNCTIONS, how="eager")


def compile_blocker() -> str | None:
    """Why this torch cannot compile the glue with the trainer's roundings (None: it can)."""
    from torch._inductor import config  # inductor loads only where the glue may compile, not for eager decoding

    if not hasattr(config, "emulate_precision_casts"):
        return (f"torch {torch.__version__}'s inductor has no emulate_precision_casts option, without which fused "
                "glue would keep float32 where the trainer rounds to bf16")
    return None


# graphs one compiled glue function may keep: one per batch size, autocast state and (add_lora) number of outputs
# met in a process. Dynamo's default (8) fails a fullgraph function hard past it: train and evaluation batches of a
# few sizes under LoRA (two add_lora graphs a size) would reach it.
GRAPHS_PER_FUNCTION = 64


def compiled(function: Callable) -> Callable:
    """function compiled for the decode step: one graph (fullgraph), fixed shapes, eager's bf16 roundings kept, up to
    GRAPHS_PER_FUNCTION shapes."""
    function = torch.compile(function, fullgraph=True, dynamic=False, options={"emulate_precision_casts": True})
    return torch._dynamo.config.patch(recompile_limit=GRAPHS_PER_FUNCTION)(function)


_DECIDED: dict[tuple[str, str], Glue] = {}


def glue_for(device: torch.device, mode: str = "eager", say=print) -> Glue:
    """The Glue for decode steps on `device`. mode "eager": eager everywhere; "compiled": compiled on CUDA (see the
    module docstring), eager elsewhere. Decided once per process for a (device type, mode), which
    is when `say` hears how; later calls return the same Glue (its compiled functions keep their compiled code)."""
    key = (torch.device(device).type, mode)
    if key not in _DECIDED:
        _DECIDED[key] = decide_glue(key[0], mode)
        say(f"decode glue (norms, residual adds, rotary embedding, sinks, LoRA adds): {_DECIDED[key].how}")
    return _DECIDED[key]


def eager_because(setting: str, device_type: str, mode: str) -> str | None:
    """How glue of this mode runs on a device of this type when it stays eager, or None when it compiles: the one
    rule of the decode glue (setting DECODE_GLUE) and the training glue (TRAIN_GLUE). An unknown mode is a
    ValueError naming the setting."""
    if mode not in GLUE_MODES:
        raise ValueError(f"{setting} must be one of {', '.join(GLUE_MODES)}, got {mode!r}")
    if mode == "eager":
        return "eager"
    if device_type != "cuda":
        return f"eager ({setting}=compiled compiles only on CUDA; this is {device_type})"
    blocker = compile_blocker()
    return None if blocker is None else f"eager on CUDA: {blocker}"


def decide_glue(device_type: str, mode: str) -> Glue:
    """A new Glue for decode steps on a device of this type (glue_for's decision, not remembered)."""
    how = eager_because("DECODE_GLUE", device_type, mode)
    if how is not None:
        return EAGER if mode == "eager" else Glue(*_FUNCTIONS, how=how)
    glue = {f.__name__: compiled(f) for f in _FUNCTIONS}
    glue["with_sinks"] = SinksUnderAutocast(glue["with_sinks"], with_sinks)
    return Glue(**glue, how="compiled (torch.compile, fullgraph, static shapes, inductor emulate_precision_casts; "
                            "the sink step only under autocast)")


@dataclass(frozen=True)
class SinksUnderAutocast:
    """with_sinks compiled where its inputs reach the log-sum-exp in float32 (under autocast, which runs logsumexp in
    float32, as the trainer's forward does), eager otherwise: eager logsumexp of bf16 inputs rounds every step to
    bf16, which inductor's compiled form does not repeat. Decided per call on the host: a captured step keeps the
    kernels of the call it recorded."""

    compiled: Callable
    eager: Callable

    def __call__(self, out: torch.Tensor, lse: torch.Tensor, sinks: torch.Tensor) -> torch.Tensor:
        under_autocast = torch.is_autocast_enabled(out.device.type)
        return (self.compiled if under_autocast else self.eager)(out, lse, sinks)
