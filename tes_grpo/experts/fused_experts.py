"""gpt-oss's MoE experts for the training forward and backward, with their elementwise work fused.
Library module, not a script; train_grpo.py installs it (TRAIN_EXPERTS), the benchmark times it:
    python benchmarks/bench_train_pass.py      # GPU machine: one micro-batch, transformers' experts against these

Why: transformers' grouped_mm path (5.17-5.24) runs every step between the two grouped GEMMs as its own kernel over
all S = tokens x 4 routed rows: a gather of the bias rows, `add_`, two clamps, `* alpha`, sigmoid, two products,
`+ 1`; then the down bias, the routing weight, a gather back to token order and the top-k sum. At a training
micro-batch (16 x 2,335 tokens, S = 149,440 rows of 5,760 / 2,880 bf16 values) that is ~28 GB of memory traffic a
layer forward, about as much again backward, and it runs twice under gradient checkpointing: a profile put this
elementwise work at several times the grouped GEMMs' share of a micro-batch's GPU time (BENCHMARKS.md, "Where a
training micro-batch went").

Here the grouped GEMMs stay transformers' (`_grouped_linear`, so its CPU fallback too) and each side of them is one
autograd Function whose forward and backward are one compiled kernel (torch.compile / inductor):
- `bias_swiglu`: + the expert's gate_up bias, gpt-oss's clamped SwiGLU over the interleaved (gate, up) columns;
- `bias_weight_combine`: + the down bias, x the routing weight, each token's top-k rows summed in token order.
The backward kernels are written out (the clamps pass gradient where the value is inside, as torch.clamp does) and
read only what the forward read; the biases must be frozen (they are under LoRA). The forward repeats every bf16
rounding of transformers' eager forward (inductor's emulate_precision_casts), so the loss is the one transformers'
path gives; the backward keeps float32 inside a kernel and rounds once (autograd's eager bf16 backward rounds after
each op), so gradients agree to bf16 precision, not bit for bit.

Compiled on CUDA; on CPU the same functions run eagerly (the tests compare them with transformers' path). Only
the training forward (grad enabled) takes this path: under no_grad and inside a CUDA graph capture the experts run
transformers' own forward, so sampling and its log-probabilities are untouched.
"""

from __future__ import annotations

import functools

import torch
from transformers.integrations.moe import _grouped_linear

from tes_grpo.experts.mxfp4_experts import is_resident

__all__ = ["bias_swiglu", "bias_swiglu_backward", "bias_weight_combine", "bias_weight_combine_backward",
           "drop_fused_experts", "experts_class", "fused_class", "fused_experts_forward", "fusable",
           "use_fused_experts", "uses_fused_experts"]


def bias_swiglu(gate_up: torch.Tensor, bias: torch.Tensor, expert_ids: torch.Tensor, alpha: float,
                limit: float) -> torch.Tensor:
    """gpt-oss's activation of rows sorted by expert: gate_up [S, 2I] (interleaved gate, up columns) + bias[expert]
    [S, 2I], then (clamp(up, +-limit) + 1) * gate' * sigmoid(alpha * gate') with gate' = min(gate, limit) -> [S, I].
    The ops and their order are transformers 5.17-5.24's (_grouped_linear's `out.add_(bias)`,
    GptOssExperts._apply_gate)."""
    h = gate_up + bias[expert_ids]
    gate = h[:, ::2].clamp(min=None, max=limit)
    up = h[:, 1::2].clamp(min=-limit, max=limit)
    glu = gate * torch.sigmoid(gate * alpha)
    return (up + 1) * glu


def _wide(t: torch.Tensor) -> torch.Tensor:
    """t in float32, or wider if it already is (float64 in the tests)."""
    return t.to(torch.promote_types(t.dtype, torch.float32))


def bias_swiglu_backward(grad: torch.Tensor, gate_up: torch.Tensor, bias: torch.Tensor, expert_ids: torch.Tensor,
                         alpha: float, limit: float) -> torch.Tensor:
    """d loss / d gate_up [S, 2I] for d loss / d bias_swiglu(...) = grad [S, I], in float32, rounded once. The
    clamps are judged on the sum as the forward rounded it, so the gradient passes exactly where the forward's did."""
    h = _wide(gate_up + bias[expert_ids])
    gate, up = h[:, ::2], h[:, 1::2]
    gate_c = gate.clamp(max=limit)
    sig = torch.sigmoid(gate_c * alpha)
    g = _wide(grad)
    d_up = g * (gate_c * sig) * ((up >= -limit) & (up <= limit))
    d_gate = g * (up.clamp(-limit, limit) + 1) * (sig + gate_c * alpha * sig * (1 - sig)) * (gate <= limit)
    return torch.stack((d_gate, d_up), dim=-1).flatten(1).to(gate_up.dtype)


def bias_weight_combine(down: torch.Tensor, bias: torch.Tensor, expert_ids: torch.Tensor, weights: torch.Tensor,
                        inv_perm: torch.Tensor, top_k: int) -> torch.Tensor:
    """Each token's output [T, H] from the down projection's rows sorted by expert, down [S, H]: + bias[expert], x
    the row's routing weight, back to token order (row inv_perm[i] of the sorted ones is routed row i), the top_k rows
    of a token summed. transformers 5.17-5.24's ops (grouped_mm_experts_forward's) in its order."""
    y = (down + bias[expert_ids]) * weights.unsqueeze(-1)
    return y[inv_perm].view(-1, top_k, y.shape[-1]).sum(dim=1)


def bias_weight_combine_backward(grad: torch.Tensor, down: torch.Tensor, bias: torch.Tensor, expert_ids: torch.Tensor,
                                 weights: torch.Tensor, perm: torch.Tensor, top_k: int):
    """(d loss / d down [S, H], d loss / d weights [S]) for d loss / d output = grad [T, H]; sorted row i came from
    token perm[i] // top_k. Gathers only (no scatter): the sorting is a permutation."""
    g = _wide(grad[perm // top_k])
    d_down = (g * _wide(weights).unsqueeze(-1)).to(down.dtype)
    d_weights = (g * _wide(down + bias[expert_ids])).sum(dim=-1).to(weights.dtype)
    return d_down, d_weights


_COMPILED: dict = {}


def _kernel(fn, like: torch.Tensor):
    """fn compiled once for CUDA tensors, fn itself elsewhere. emulate_precision_casts: inductor rounds where eager
    rounds (by default it keeps a fused chain in float32), so compiled and eager give the same numbers."""
    if like.device.type != "cuda":
        return fn
    if fn not in _COMPILED:
        _COMPILED[fn] = torch.compile(fn, fullgraph=True, options={"emulate_precision_casts": True})
    return _COMPILED[fn]


def _rows_vary(*tensors: torch.Tensor) -> None:
    """Tells torch.compile that dim 0 (rows, tokens) changes from call to call: one kernel for every micro-batch
    instead of a recompile per length (its default specializes on the first length seen)."""
    for t in tensors:
        torch._dynamo.maybe_mark_dynamic(t, 0)


class _BiasSwiGLU(torch.autograd.Function):
    @staticmethod
    def forward(ctx, gate_up, bias, expert_ids, alpha, limit):
        ctx.save_for_backward(gate_up, bias, expert_ids)
        ctx.alpha, ctx.limit = alpha, limit
        _rows_vary(gate_up, expert_ids)
        return _kernel(bias_swiglu, gate_up)(gate_up, bias, expert_ids, alpha, limit)

    @staticmethod
    def backward(ctx, grad):
        gate_up, bias, expert_ids = ctx.saved_tensors
        grad = grad.contiguous()
        _rows_vary(grad, gate_up, expert_ids)
        d_gate_up = _kernel(bias_swiglu_backward, grad)(grad, gate_up, bias, expert_ids, ctx.alpha, ctx.limit)
        return d_gate_up, None, None, None, None


class _BiasWeightCombine(torch.autograd.Function):
    @staticmethod
    def forward(ctx, down, bias, expert_ids, weights, perm, inv_perm, top_k):
        ctx.save_for_backward(down, bias, expert_ids, weights, perm)
        ctx.top_k = top_k
        _rows_vary(down, expert_ids, weights, inv_perm)
        return _kernel(bias_weight_combine, down)(down, bias, expert_ids, weights, inv_perm, top_k)

    @staticmethod
    def backward(ctx, grad):
        down, bias, expert_ids, weights, perm = ctx.saved_tensors
        grad = grad.contiguous()
        _rows_vary(grad, down, expert_ids, weights, perm)
        d_down, d_weights = _kernel(bias_weight_combine_backward, grad)(grad, down, bias, expert_ids, weights, perm,
                                                                         ctx.top_k)
        return d_down, None, None, d_weights, None, None, None


def fused_experts_forward(experts, hidden_states: torch.Tensor, top_k_index: torch.Tensor,
                          top_k_weights: torch.Tensor) -> torch.Tensor:
    """transformers 5.17-5.24's grouped_mm_experts_forward for GptOssExperts with the two fused Functions (the
    grouped GEMMs its own _grouped_linear): hidden_states [T, H], top_k_index / top_k_weights [T, k] -> [T, H]."""
    top_k = top_k_index.shape[-1]
    expert_ids, perm = torch.sort(top_k_index.reshape(-1))
    inv_perm = torch.empty_like(perm)
    inv_perm[perm] = torch.arange(perm.numel(), device=perm.device)
    rows = hidden_states[perm // top_k]
    weights = top_k_weights.reshape(-1)[perm]
    # transformers' offsets: histc (int on CUDA, float on CPU) then a cumulative sum
    counts = torch.histc(expert_ids.int() if expert_ids.is_cuda else expert_ids.float(),
                         bins=experts.num_experts, min=0, max=experts.num_experts - 1)
    offsets = torch.cumsum(counts, dim=0, dtype=torch.int32)
    gate_up = _grouped_linear(rows, experts.gate_up_proj, offsets, is_transposed=experts.is_transposed)
    act = _BiasSwiGLU.apply(gate_up, experts.gate_up_proj_bias, expert_ids, float(experts.alpha),
                            float(experts.limit))
    down = _grouped_linear(act, experts.down_proj, offsets, is_transposed=experts.is_transposed)
    out = _BiasWeightCombine.apply(down, experts.down_proj_bias, expert_ids, weights, perm, inv_perm, top_k)
    return out.to(hidden_states.dtype)


def _has(module, name: str) -> bool:
    """hasattr without reading a property: a resident MXFP4 experts module (mxfp4_experts.py) would dequantize."""
    return (hasattr(type(module), name) or name in vars(module) or name in module._parameters
            or name in module._buffers)


def fusable(experts) -> list[str]:
    """Why this experts module cannot take the fused path (empty: it can)."""
    reasons = []
    for name in ("gate_up_proj", "gate_up_proj_bias", "down_proj", "down_proj_bias", "alpha", "limit",
                 "is_transposed", "num_experts"):
        if not _has(experts, name):
            reasons.append(f"no {name} (not transformers' GptOssExperts of 5.17-5.23)")
    if reasons:
        return reasons
    if getattr(experts, "_is_expert_parallel", False):
        reasons.append("expert parallel (sentinel rows)")
    for name in ("gate_up_proj_bias", "down_proj_bias"):
        if getattr(experts, name).requires_grad:
            reasons.append(f"{name} is trainable (the fused backward gives biases no gradient)")
    return reasons


def _training_forward(self, hidden_states, router_indices=None, routing_weights=None):
    """The fused variant's forward, with transformers 5.17-5.24's GptOssExperts.forward signature: the fused path
    while gradients are on, the class's own forward otherwise (or where the module cannot take it)."""
    capturing = hidden_states.is_cuda and torch.cuda.is_current_stream_capturing()
    if not torch.is_grad_enabled() or capturing or fusable(self):
        return self.without_fused.forward(self, hidden_states, router_indices, routing_weights)
    return fused_experts_forward(self, hidden_states, router_indices, routing_weights)


@functools.cache
def fused_class(cls: type) -> type:
    """The fused-training variant of an experts class (one per class, so isinstance(module, cls) still holds): its
    forward is the fused one while gradients are on, `without_fused` the class it came from (whose forward runs
    otherwise); a name in this module, so a pickled model finds it again."""
    name = f"Fused{cls.__name__}"
    variant = type(name, (cls,), {"__module__": __name__, "__qualname__": name, "without_fused": cls,
                                  "forward": _training_forward})
    globals()[name] = variant
    return variant


def experts_class(module) -> type:
    """The experts class a module is, under the fused-training variant use_fused_experts may have given it."""
    return getattr(type(module), "without_fused", type(module))


def uses_fused_experts(module) -> bool:
    return experts_class(module) is not type(module)


def drop_fused_experts(model) -> int:
    """Gives the experts modules use_fused_experts changed their class back; returns how many."""
    dropped = 0
    for module in model.modules():
        if uses_fused_experts(module):
            module.__class__ = experts_class(module)
            dropped += 1
    return dropped


def use_fused_experts(model, say=print) -> int:
    """Gives every gpt-oss experts module of `model` the fused training forward (its class swapped for fused_class's
    variant, whose forward runs the class's own under no_grad); returns how many. Modules that cannot take it keep
    transformers' forward, and `say` names them and why."""
    done, refused = 0, {}
    for name, module in model.named_modules():
        if uses_fused_experts(module):
            done += 1
            continue
        if type(module).__name__ != "GptOssExperts" and not is_resident(module):
            continue
        reasons = fusable(module)
        if reasons:
            refused.setdefault("; ".join(reasons), []).append(name)
            continue
        module.__class__ = fused_class(type(module))
        done += 1
    for why, names in refused.items():
        say(f"TRAIN_EXPERTS=fused: {len(names)} experts module(s) keep transformers' forward ({why}), e.g. {names[0]}")
    return done
