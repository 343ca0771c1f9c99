"""The training forward's glue: the small steps between its matrix products, fused (TRAIN_GLUE).

Library module, not a script; fast_paths.py decides whether a run takes it and installs it, the benchmarks time it:
    python benchmarks/bench_train_pass.py --VARIANTS=fused+bounds,fused+bounds+glue   # GPU machine: a pass, both ways
    python benchmarks/bench_grpo.py --PROFILE_TRAIN=1 --TRAIN_GLUE=eager               # a micro-batch's kernels

Why: run kernel by kernel, the steps between a training pass's matrix products are a large share of its time
(BENCHMARKS.md's training profile). Four sources, each over every token of a micro-batch, in the forward, again in
gradient checkpointing's recompute, and in the backward:
- GptOssRMSNorm: the hidden states cast to float32, squared, averaged, scaled, multiplied by the weight and cast
  back, each a kernel over a [tokens, 2,880] tensor, most of them float32, and as many again backward;
- PEFT's lora.Linear: its forward casts the input to the adapter's float32 before lora_A, which autocast casts back
  to bf16 for the product (two copies of the input per projection, four projections a layer, nothing changed by
  them), then multiplies the adapter's output by the scaling and adds it, a kernel each;
- the rotary embedding (transformers' apply_rotary_pos_emb): four products, a sum, a difference and a concatenation
  over the query and the key;
- flex attention's sink step (transformers' flex_attention_forward): the output times a float32 factor, a float32
  copy of the whole output, then cast back to bf16 (before the transposed copy it returns).

Here, while gradients are on (the training forward):
- each GptOssRMSNorm computes decode_glue.rms_norm (its forward cast for cast) compiled, its backward derived by
  torch.compile from the same function;
- each plain-LoRA projection (lora.py's lora_parts takes it) computes base_layer(x) and lora_B(lora_A(x)) on the
  input as it comes where PEFT's cast to the adapter's dtype changes nothing lora_A computes (no cast needed, or
  autocast casts to its own dtype from a float32 or same-dtype adapter), and adds `result + low * scaling` in one
  compiled kernel;
- the rotary embedding runs transformers' own function compiled, and, under autocast on CUDA, flex attention runs
  without the sinks, which `with_sinks` then applies to its transposed output in one compiled kernel (without
  autocast inductor's log-sum-exp of bf16 inputs would round other than eager's, as decode_glue says; there the
  library's step runs). patches/transformers_patches.py installs these two.
Under no_grad (the sampler's prefill, TRL's log-probabilities of a batch trained over several optimizer steps,
evaluation) the libraries' code runs, so the sampler and those log-probabilities see the libraries' norm and sink
step: the training forward's may differ from them by one bf16 ulp on a few elements (below), which the sampler-trainer
gap measures every step. train_grpo checkpoints non-reentrantly, so the recompute runs the training forward's glue
too.
Compiled with inductor's emulate_precision_casts, every bf16 rounding of the eager forward is kept; the products,
sums and concatenation are elementwise, so the LoRA add and the rotary embedding give eager's numbers bit for bit.
The norm's mean is a float32 reduction in another order, and the sink step's float32 exp and log come from Triton's
math library: either can move a bf16 result by one unit in the last place on a few elements (as decode_glue's
compiled norm and sink step do; tests/gpu_cuda_test.py). Backward, the compiled kernels keep
float32 between their steps and round once, so gradients agree with autograd's eager ones to bf16 precision.

`decide(device_type, mode)` says how the functions run (compiled on CUDA, eager elsewhere or where inductor lacks
the option; decided once per process for a device type and mode); `use_train_glue(model, glue)` gives the norms and
the LoRA projections their training forward (each module's class swapped for a subclass whose forward is the one
below, as torch's parametrize and mxfp4_experts.py do: nothing is rebound on an instance) and returns how many of
each.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from dataclasses import dataclass

import torch
from peft.tuners.lora.layer import Linear as LoraLinear
from transformers.models.gpt_oss.modeling_gpt_oss import GptOssRMSNorm, apply_rotary_pos_emb

from tes_grpo.layers import decode_glue
from tes_grpo.layers.lora import lora_parts
from tes_grpo.patches import transformers_patches
from tes_grpo.run.processes import say as _say

__all__ = ["EAGER", "GLUE_MODES", "RopeForTraining", "SinksInTraining", "TrainGlue", "add_scaled", "compiled",
           "decide", "drop_train_glue", "lora_training_forward", "norm_training_forward", "rms_norm", "rope",
           "rope_through", "sinks_through", "use_train_glue", "uses_train_glue", "with_sinks"]

GLUE_MODES = decode_glue.GLUE_MODES
# graphs a compiled function may keep: dims that change between micro-batches are marked dynamic, so a few suffice
# (autocast on and off, a sliding and a full layer's shapes); dynamo's default of 8 would fail fullgraph hard past it
GRAPHS_PER_FUNCTION = 32


def rms_norm(hidden: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """decode_glue.rms_norm (transformers 5.17-5.24's GptOssRMSNorm.forward) behind a code object of its own:
    torch.compile keeps compiled graphs per code object, so these (lengths dynamic) and the decode step's (fixed
    shapes) never share a cache."""
    return decode_glue.rms_norm(hidden, weight, eps)


def add_scaled(result: torch.Tensor, low: torch.Tensor, scaling: float) -> torch.Tensor:
    """PEFT 0.21's lora.Linear.forward after its products: `(result + low * scaling).to(result.dtype)`, low being
    lora_B(lora_A(x))."""
    return (result + low * scaling).to(result.dtype)


def rope(q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
         unsqueeze_dim: int = 1) -> tuple[torch.Tensor, torch.Tensor]:
    """transformers' apply_rotary_pos_emb for gpt-oss (5.17-5.24), called as the attention calls it."""
    return apply_rotary_pos_emb(q, k, cos, sin, unsqueeze_dim)


def with_sinks(out: torch.Tensor, lse: torch.Tensor, sinks: torch.Tensor) -> torch.Tensor:
    """transformers 5.17-5.24's flex attention renormalisation for gpt-oss's sinks (integrations/flex_attention.py:
    logsumexp of the log-sum-exp with the sink, out * exp(lse - combined), rounded to out's dtype;
    decode_glue.with_sinks mirrors it for the decode step), applied to the output as that function returns it:
    out [B, L, H, D] (transposed, contiguous), lse [B, H, L] in the values' dtype, sinks [H]."""
    batch, heads, length = lse.shape
    lse = lse.unsqueeze(-1)
    sink = sinks.view(1, -1, 1, 1).expand(batch, heads, length, 1)
    combined = torch.logsumexp(torch.cat([lse, sink], dim=-1), dim=-1, keepdim=True)
    return (out * torch.exp(lse - combined).transpose(1, 2)).to(out.dtype)


def _vary(tensor: torch.Tensor, dims: tuple[int, ...]) -> torch.Tensor:
    """Tells torch.compile these dims (batch, length) change between calls: one graph for every micro-batch."""
    for d in dims:
        torch._dynamo.maybe_mark_dynamic(tensor, d)
    return tensor


def compiled(function: Callable) -> Callable:
    """function through torch.compile: one graph (fullgraph), eager's bf16 roundings kept, dims marked by the caller
    dynamic, up to GRAPHS_PER_FUNCTION graphs."""
    function = torch.compile(function, fullgraph=True, options={"emulate_precision_casts": True})
    return torch._dynamo.config.patch(recompile_limit=GRAPHS_PER_FUNCTION)(function)


@dataclass(frozen=True)
class TrainGlue:
    """The functions the training forward calls (each with its namesake's signature above), and `how`: one line
    saying how they run."""

    rms_norm: Callable
    add_scaled: Callable
    rope: Callable
    with_sinks: Callable
    how: str

    def norm(self, hidden: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
        """rms_norm, every dim but the hidden one dynamic."""
        return self.rms_norm(_vary(hidden, tuple(range(hidden.dim() - 1))), weight, eps)

    def add(self, result: torch.Tensor, low: torch.Tensor, scaling: float) -> torch.Tensor:
        """add_scaled, every dim but the output one dynamic."""
        dims = tuple(range(result.dim() - 1))
        return self.add_scaled(_vary(result, dims), _vary(low, dims), scaling)

    def rotary(self, q, k, cos, sin, unsqueeze_dim: int = 1):
        """rope, batch and length dynamic."""
        if q.dim() == 4 and unsqueeze_dim == 1:  # [batch, heads, length, head_dim]; cos, sin [batch, length, dim]
            q, k, cos, sin = _vary(q, (0, 2)), _vary(k, (0, 2)), _vary(cos, (0, 1)), _vary(sin, (0, 1))
        return self.rope(q, k, cos, sin, unsqueeze_dim)

    def sinks(self, out: torch.Tensor, lse: torch.Tensor, sinks: torch.Tensor) -> torch.Tensor:
        """with_sinks, batch and length dynamic."""
        return self.with_sinks(_vary(out, (0, 1)), _vary(lse, (0, 2)), sinks)


_FUNCTIONS = (rms_norm, add_scaled, rope, with_sinks)
EAGER = TrainGlue(*_FUNCTIONS, how="eager")


_DECIDED: dict[tuple[str, str], TrainGlue] = {}


def decide(device_type: str, mode: str) -> TrainGlue:
    """The TrainGlue for a training forward on a device of this type: mode "eager" runs the functions kernel by
    kernel; "compiled" compiles them on CUDA (eager elsewhere, said in `how`). Once per process for a (device type,
    mode): later calls return the same TrainGlue, whose compiled functions keep their graphs."""
    if (device_type, mode) not in _DECIDED:
        _DECIDED[device_type, mode] = _new_glue(device_type, mode)
    return _DECIDED[device_type, mode]


def _new_glue(device_type: str, mode: str) -> TrainGlue:
    how = decode_glue.eager_because("TRAIN_GLUE", device_type, mode)
    if how is not None:
        return EAGER if mode == "eager" else TrainGlue(*_FUNCTIONS, how=how)
    return TrainGlue(*(compiled(f) for f in _FUNCTIONS),
                     how="compiled (torch.compile, fullgraph, batch and length dynamic, inductor "
                         "emulate_precision_casts)")


def _training(t: torch.Tensor) -> bool:
    """Whether a call belongs to the training forward this module fuses: gradients on, not in a CUDA graph capture."""
    return torch.is_grad_enabled() and not (t.is_cuda and torch.cuda.is_current_stream_capturing())


def norm_training_forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
    """transformers 5.17-5.24's GptOssRMSNorm.forward in the training forward: the glue's rms_norm of its weight and
    epsilon (the same function, cast for cast)."""
    if not _training(hidden_states):
        return self.without_glue.forward(self, hidden_states)
    return self._train_glue.norm(hidden_states, self.weight, self.variance_epsilon)


def lora_training_forward(self, x: torch.Tensor, *args, **kwargs) -> torch.Tensor:
    """peft 0.21's lora.Linear.forward in the training forward, for a plain adapter (lora.py's lora_parts): the base
    layer, then lora_B(lora_A(x)) on x as it comes where autocast casts it to the same dtype anyway (PEFT first
    casts it to the adapter's dtype), added by the glue's add_scaled. Anything else runs PEFT's forward."""
    parts = None if args or kwargs or not _training(x) else lora_parts(self)
    if parts is None or parts[2] is None:
        return self.without_glue.forward(self, x, *args, **kwargs)
    name = next(a for a in self.active_adapters if a in self.lora_A)
    lora_A, lora_B = self.lora_A[name], self.lora_B[name]
    if not cast_changes_nothing(x, lora_A.weight.dtype):
        return self.without_glue.forward(self, x, *args, **kwargs)
    result = self.base_layer(x)
    return self._train_glue.add(result, lora_B(lora_A(self.lora_dropout[name](x))), self.scaling[name])


@functools.cache
def glue_class(cls: type) -> type:
    """The training-glue variant of a norm or LoRA layer class (one per class, so isinstance(module, cls) still
    holds): its forward is norm_training_forward or lora_training_forward, `without_glue` the class it came from,
    and norms keep computing rms_norm (decode_glue.norm_weights reads their weights); a name in this module, so a
    pickled model finds it again."""
    norm = issubclass(cls, GptOssRMSNorm)
    name = f"TrainGlue{cls.__name__}"
    attributes = {"__module__": __name__, "__qualname__": name, "without_glue": cls, "computes_rms_norm": norm,
                  "forward": norm_training_forward if norm else lora_training_forward}
    variant = type(name, (cls,), attributes)
    globals()[name] = variant
    return variant


def cast_changes_nothing(x: torch.Tensor, adapter_dtype: torch.dtype) -> bool:
    """Whether lora_A computes the same on x as on PEFT's x.to(adapter_dtype): no cast at all, or autocast on, which
    casts the product's input to its own dtype, from an adapter dtype that either holds x exactly on the way (float32
    holds bf16 and fp16) or is autocast's dtype itself."""
    if x.dtype == adapter_dtype:
        return True
    device = x.device.type
    return torch.is_autocast_enabled(device) and adapter_dtype in (torch.float32, torch.get_autocast_dtype(device))


class RopeForTraining:
    """apply_rotary_pos_emb's replacement: the glue's rope in the training forward, `wraps_original` elsewhere."""

    def __init__(self, original: Callable, glue: TrainGlue):
        self.wraps_original, self.glue = original, glue

    def __call__(self, q, k, cos, sin, unsqueeze_dim=1):
        if not _training(q):
            return self.wraps_original(q, k, cos, sin, unsqueeze_dim)
        return self.glue.rotary(q, k, cos, sin, unsqueeze_dim)


class SinksInTraining:
    """An attention function (transformers' ALL_ATTENTION_FUNCTIONS entry) whose sink step in the training forward is
    the glue's with_sinks on the output it returns: the wrapped function runs without the sinks, on CUDA (where flex
    attention returns the log-sum-exp), with gradients on, under autocast (module docstring); anything else calls it
    as it is. Called as transformers 5.17-5.24's GptOssAttention.forward calls its attention function (sinks as
    `s_aux`), wrapping flex_attention_forward, which returns (output, log-sum-exp)."""

    def __init__(self, original: Callable, glue: TrainGlue):
        self.wraps_original, self.glue = original, glue

    def __call__(self, module, query, key, value, attention_mask, *args, s_aux=None, **kwargs):
        if (s_aux is None or args or not query.is_cuda or not _training(query)
                or not torch.is_autocast_enabled(query.device.type)):
            return self.wraps_original(module, query, key, value, attention_mask, *args, s_aux=s_aux, **kwargs)
        out, lse = self.wraps_original(module, query, key, value, attention_mask, **kwargs)
        if lse is None:
            raise RuntimeError("TRAIN_GLUE: this transformers' flex attention returned no log-sum-exp on CUDA, which "
                               "the sink step needs; set TRAIN_GLUE=eager")
        return self.glue.sinks(out, lse, s_aux), lse


def rope_through(glue: TrainGlue | None, say=_say) -> bool:
    """transformers' rotary embedding runs through `glue` in the training forward (RopeForTraining, installed by
    patches.transformers_patches.rotary_embedding_in_training); None puts the library's function back."""
    wrap = None if glue is None else functools.partial(RopeForTraining, glue=glue)
    return transformers_patches.rotary_embedding_in_training(wrap, say)


def sinks_through(glue: TrainGlue | None, say=_say) -> bool:
    """flex attention's sink step runs through `glue` in the training forward (SinksInTraining, installed by
    patches.transformers_patches.flex_sinks_in_training); None puts the library's entry back."""
    wrap = None if glue is None else functools.partial(SinksInTraining, glue=glue)
    return transformers_patches.flex_sinks_in_training(wrap, say)


def _is_lora_linear(module) -> bool:
    """A PEFT LoRA layer over an nn.Linear that runs lora.Linear's own forward (the one lora_training_forward
    mirrors; a subclass with another forward keeps it)."""
    return (isinstance(module, LoraLinear) and type(module).forward is LoraLinear.forward
            and type(getattr(module, "base_layer", None)) is torch.nn.Linear)


def use_train_glue(model, glue: TrainGlue) -> tuple[int, int]:
    """Gives every GptOssRMSNorm (running its class's forward) and every LoRA projection of `model` its training
    forward above (glue_class), calling `glue`; returns (norms, projections). Modules that have it already take the
    new glue; modules whose forward was replaced otherwise (a hub kernel) are left as they are."""
    norms = projections = 0
    for module in model.modules():
        if not uses_train_glue(module):
            if "forward" in vars(module) or not (type(module) is GptOssRMSNorm or _is_lora_linear(module)):
                continue
            module.__class__ = glue_class(type(module))
        module._train_glue = glue
        norms += isinstance(module, GptOssRMSNorm)
        projections += not isinstance(module, GptOssRMSNorm)
    return norms, projections


def uses_train_glue(module) -> bool:
    """Whether use_train_glue gave `module` its training forward."""
    return getattr(type(module), "without_glue", None) is not None


def drop_train_glue(model) -> int:
    """Gives the modules use_train_glue changed their class back; returns how many."""
    dropped = 0
    for module in model.modules():
        if uses_train_glue(module):
            module.__class__ = type(module).without_glue
            del module._train_glue
            dropped += 1
    return dropped
