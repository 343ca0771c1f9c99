"""gpt-oss's frozen MoE experts kept as one resident MXFP4 copy that serves training and decoding. Library module,
not a script.

model_loading.load_training_model(..., experts="auto" | "mxfp4") loads a checkpoint straight into this form
(load_resident_model: the bf16 experts are never built); make_experts_resident converts a model already loaded;
gpt_oss_shapes builds random 20B/120B-shaped models with it; the benchmark times it:

    python benchmarks/bench_mxfp4_load.py      # GPU machine: load, dequantization, one MoE layer both ways

Why: under the recipe's LoRA (attention only) the experts, ~91 % of gpt-oss's parameters, are frozen, yet they were
held twice: dequantized to bf16 at load for training (Mxfp4Config(dequantize=True)), and packed again as MXFP4 by
mxfp4_decode.py for decoding. The checkpoint's MXFP4 blocks and scales determine the bf16 values exactly, so they
are kept as the only copy (4.25 bits a value instead of 16), and each layer's bf16 weights exist only while that
layer runs.

How:
- A resident experts module is transformers' own experts module (its class, its forward and experts
  implementation, fused_experts.py's training forward) with `gate_up_proj` / `down_proj` taken out of its parameters
  and read through properties instead: the checkpoint's `{proj}_blocks` (uint8 [E, out, in/32, 16] in the
  checkpoint) and `{proj}_scales` (uint8 [E, out, in/32]) are non-persistent buffers in their place, in the Hopper
  layout (next point), and the property dequantizes them to the tensor transformers would hold: [E, in, out],
  contiguous, in the dtype the dequantized load would give (bf16 on a GPU, float32 on the CPU).
- The buffers hold those bytes in OpenAI triton_kernels' Hopper MXFP4 layout (mxfp4.to_hopper_layout: blocks
  [E, out / 4, 2 in], scales [E, out / 32, in], padded to whole 128 x 128 tiles with zeros), the order
  mxfp4_decode's kernel reads (a lane's loaded bytes are its tensor-core operand registers), so decoding reads them
  with no copy; the dequantization reads the same layout. put_checkpoint_tensor stores a checkpoint tensor,
  checkpoint_tensor and resident_state give them back in the checkpoint's layout.
- Each call of the module (the layer's forward, its recompute under gradient checkpointing, a decoding step)
  dequantizes each projection once, when first read, and drops it when the call returns; the caching allocator
  reuses the memory for the next layer.
- Autograd would keep the dequantized weights alive from forward to backward (a grouped matmul saves its weight to
  compute the input's gradient). During the call, saved-tensor hooks store a saved tensor that lies in one of the
  dequantized weights as a small handle, and dequantize again when the backward unpacks it. Every other saved tensor
  goes to the hooks that were active when the call began (gradient checkpointing's, which would otherwise be
  shadowed: torch applies only the innermost hooks), so activation checkpointing works as before; torch exposes
  those outer hooks only privately (patches.torch_patches.saved_tensors_hooks_now; make_resident refuses without it).

Why this is bit-exact: the property returns the same values (the dequantization equals transformers' own, checked
for every byte and scale value in the tests), with the same shape, strides, dtype and device as the parameter of the
dequantized load, so every op of the forward runs on the same inputs; the backward is autograd's own, unchanged,
fed the same weights again (dequantization is deterministic). Nothing else in the graph changes.

Why buffers, not parameters: they are never trained, and several processes need them as a whole on every GPU.
- FSDP2 shards parameters only: it would split the blocks across the GPUs and gather them per layer, and torch
  2.11 cannot even shard a uint8 parameter (its fully_shard re-creates each one as a parameter that requires grad).
  Buffers stay whole on each GPU: replicated, the same forward as on one GPU.
- Non-persistent, so no state dict holds them: accelerate's FSDP2 loading (fsdp_cpu_ram_efficient_loading) reloads
  every state-dict entry as a shard, and keeps the non-persistent buffers of each process as they are (each
  process therefore loads the blocks itself: model_loading.empty_policy_model); checkpoints and adapters never
  gather them. resident_state gives them by their checkpoint names where a full checkpoint is written.
- DDP would broadcast buffers from rank 0 before every forward; train_grpo turns that off (ddp_broadcast_buffers):
  every process loaded the same bytes, and no buffer of gpt-oss changes while training.
- `.parameters()` does not count them (resident_bytes does), and `.to(device)` moves them like any buffer.

Dequantization (mxfp4_dequant.py): on CUDA a Triton kernel writes the [E, in, out] weights straight from the
packed bytes; elsewhere (and on CUDA without Triton, said once) torch's codec.

Decoding: mxfp4_decode.pack_model hands a resident layer's blocks and scales to its kernel as they are (no copy).
Layers whose experts carry LoRA (train_grpo's LORA_EXPERT_LAYERS) keep ordinary bf16 parameters: PEFT adapts a
parameter in place, and a trained weight has no fixed MXFP4 form.
"""

from __future__ import annotations

import functools
import re
from collections.abc import Mapping
from dataclasses import dataclass, field

import torch

from tes_grpo.experts.mxfp4 import BLOCK_SIZE, from_hopper_layout, quantize_mxfp4, to_hopper_layout
from tes_grpo.experts.mxfp4_dequant import dequantize_experts
from tes_grpo.patches.torch_patches import saved_tensors_hooks_now, saved_tensors_hooks_readable

PROJECTIONS = ("gate_up_proj", "down_proj")
_LAYER_RE = re.compile(r"(?:^|\.)layers\.(\d+)\.mlp\.experts$")

__all__ = ["PROJECTIONS", "ResidentState", "ResidentSummary", "checkpoint_tensor", "expert_layer_index", "is_resident",
           "make_experts_resident", "make_resident", "matrix_sizes", "put_checkpoint_tensor", "resident_bytes",
           "resident_layers", "resident_state", "residency_line"]


# ---------------------------------------------------------------------------------------------------------------
# The resident experts module
# ---------------------------------------------------------------------------------------------------------------

class _Rebuild:
    """Dequantizes one projection again for the backward. Keeps the result while handles packed in the same call
    are still to be unpacked (the eager experts loop saves one slice per expert), then lets it go."""

    def __init__(self, experts, name: str):
        self.experts, self.name = experts, name
        self.pending = 0
        self.weight: torch.Tensor | None = None

    def unpack(self, size, stride, offset) -> torch.Tensor:
        weight = self.weight if self.weight is not None else self.experts.dequantize(self.name)
        self.pending -= 1
        self.weight = weight if self.pending > 0 else None
        return weight.as_strided(size, stride, offset)


@dataclass(frozen=True)
class _WeightHandle:
    """What autograd keeps of a saved tensor that lies in a dequantized weight: where in it, not its values."""

    rebuild: _Rebuild
    size: tuple
    stride: tuple
    offset: int


@dataclass(frozen=True)
class _OuterPacked:
    """A saved tensor packed by the hooks that were active when the call began (gradient checkpointing's)."""

    unpack: object
    packed: object


class _JustInTime:
    """One call of a resident experts module: its dequantized weights, and (with grad on) the saved-tensor hooks."""

    def __init__(self, experts):
        self.experts = experts
        self.weights: dict[str, torch.Tensor] = {}
        self.rebuilds: dict[str, _Rebuild] = {}
        self.outer = saved_tensors_hooks_now() if torch.is_grad_enabled() else None
        self.hooks = (torch.autograd.graph.saved_tensors_hooks(self.pack, self.unpack)
                      if torch.is_grad_enabled() else None)

    def weight(self, name: str) -> torch.Tensor:
        if name not in self.weights:
            self.weights[name] = self.experts.dequantize(name)
        return self.weights[name]

    def pack(self, tensor: torch.Tensor):
        for name, weight in self.weights.items():
            if (tensor.device == weight.device and tensor.dtype == weight.dtype
                    and tensor.untyped_storage().data_ptr() == weight.untyped_storage().data_ptr()):
                rebuild = self.rebuilds.setdefault(name, _Rebuild(self.experts, name))
                rebuild.pending += 1
                return _WeightHandle(rebuild, tuple(tensor.shape), tuple(tensor.stride()), tensor.storage_offset())
        if self.outer is not None:
            return _OuterPacked(self.outer[1], self.outer[0](tensor))
        return tensor

    @staticmethod
    def unpack(packed):
        if isinstance(packed, _WeightHandle):
            return packed.rebuild.unpack(packed.size, packed.stride, packed.offset)
        if isinstance(packed, _OuterPacked):
            return packed.unpack(packed.packed)
        return packed

    def __enter__(self):
        if self.hooks is not None:
            self.hooks.__enter__()
        self.experts.__dict__["_just_in_time"] = self
        return self

    def __exit__(self, *exc):
        self.experts.__dict__.pop("_just_in_time", None)
        self.weights.clear()
        if self.hooks is not None:
            self.hooks.__exit__(*exc)
        # The hooks hold this object's bound methods and `outer` holds gradient checkpointing's hooks, whose closures
        # hold the checkpointed layer's frame (its inputs and recomputed tensors): left in place, that reference
        # cycle keeps a whole micro-batch's activations until Python's cyclic collector happens to run, which it
        # does by object counts, not GPU memory (measured: out of memory at the second GRPO step on an H100).
        self.hooks = self.outer = None
        return False


class ResidentMxfp4Experts:
    """Mixed into a gpt-oss experts class (resident_class): gate_up_proj / down_proj dequantized from the resident
    `{proj}_blocks` / `{proj}_scales` buffers when read, once per call of the module (see the module docstring).
    transformers 5.17-5.24's experts forwards (GptOssExperts.forward, grouped_mm_experts_forward) read each projection
    as an attribute within the call; `_apply` follows torch 2.11-2.13's Module._apply, whose `fn` converts the
    module's tensors (what the dequantized load's parameters would become)."""

    mxfp4_resident = True
    expert_dtype: torch.dtype  # what the dequantized load's parameters would be: the forward's weight dtype

    def __call__(self, *args, **kwargs):
        with _JustInTime(self):
            return super().__call__(*args, **kwargs)

    def dequantize(self, name: str) -> torch.Tensor:
        """A fresh [E, in, out] tensor of projection `name` in expert_dtype, on the blocks' device."""
        return dequantize_experts(getattr(self, f"{name}_blocks"), getattr(self, f"{name}_scales"), self.expert_dtype,
                                  size=matrix_sizes(self)[name])

    def _expert_weight(self, name: str) -> torch.Tensor:
        scope = self.__dict__.get("_just_in_time")
        return scope.weight(name) if scope is not None else self.dequantize(name)

    @property
    def gate_up_proj(self) -> torch.Tensor:
        return self._expert_weight("gate_up_proj")

    @property
    def down_proj(self) -> torch.Tensor:
        return self._expert_weight("down_proj")

    def _apply(self, fn, recurse=True):
        # .to(dtype) / .half() / .float() change what the dequantized load's parameters would have become
        result = super()._apply(fn, recurse)
        self.expert_dtype = fn(torch.empty(0, dtype=self.expert_dtype)).dtype
        return result

    def extra_repr(self) -> str:
        blocks = self.gate_up_proj_blocks
        return (f"resident MXFP4 in the Hopper layout: {blocks.shape[0]} experts, gate_up_proj / down_proj "
                f"dequantized to {self.expert_dtype} when called")


@functools.cache
def resident_class(cls: type) -> type:
    """The resident variant of an experts class (one per class, so isinstance(module, cls) still holds); a name in
    this module, so a pickled model finds it again."""
    name = f"ResidentMxfp4{cls.__name__}"
    resident = type(name, (ResidentMxfp4Experts, cls), {"__module__": __name__, "__qualname__": name})
    globals()[name] = resident
    return resident


def is_resident(module) -> bool:
    return bool(getattr(type(module), "mxfp4_resident", False))


def matrix_sizes(experts) -> dict[str, tuple[int, int]]:
    """(out, in) of each projection's weight matrix, as the checkpoint stores it."""
    h, i = experts.hidden_size, experts.intermediate_size
    return {"gate_up_proj": (2 * i, h), "down_proj": (h, i)}


def expected_shapes(experts) -> dict[str, tuple[int, ...]]:
    """The checkpoint's `{proj}_{blocks|scales}` shapes for this experts module."""
    shapes = {}
    for name, (rows, cols) in matrix_sizes(experts).items():
        shapes[f"{name}_blocks"] = (experts.num_experts, rows, cols // BLOCK_SIZE, BLOCK_SIZE // 2)
        shapes[f"{name}_scales"] = (experts.num_experts, rows, cols // BLOCK_SIZE)
    return shapes


def _split(name: str) -> tuple[str, str]:
    """`{proj}_{blocks|scales}` -> (proj, part)."""
    proj, _, part = name.rpartition("_")
    return proj, part


def put_checkpoint_tensor(experts, name: str, tensor: torch.Tensor) -> None:
    """Stores a checkpoint's `{proj}_{blocks|scales}` tensor (its layout and shape, on the device it is on) into a
    resident module, in the Hopper layout."""
    expected = expected_shapes(experts)
    if name not in expected:
        raise ValueError(f"put_checkpoint_tensor: {name!r} is none of {sorted(expected)}")
    if tensor.dtype != torch.uint8 or tuple(tensor.shape) != expected[name]:
        raise ValueError(f"{name}: {tensor.dtype} {tuple(tensor.shape)}, expected uint8 {expected[name]}")
    experts._buffers[name] = to_hopper_layout(tensor, _split(name)[1])


def checkpoint_tensor(experts, name: str) -> torch.Tensor:
    """A resident module's `{proj}_{blocks|scales}` back in the checkpoint's layout (a new tensor)."""
    proj, part = _split(name)
    return from_hopper_layout(getattr(experts, name), part, *matrix_sizes(experts)[proj])


def make_resident(experts, tensors: Mapping[str, torch.Tensor], dtype: torch.dtype) -> None:
    """Turns one gpt-oss experts module resident in place: `tensors` holds its `{proj}_blocks` / `{proj}_scales`
    (uint8, checkpoint layout; meta tensors for a skeleton), kept in the Hopper layout (mxfp4.to_hopper_layout, what
    mxfp4_decode's kernel reads; dequantize reads it too); `dtype` the weights' dtype when dequantized. Drops the
    module's gate_up_proj / down_proj parameters."""
    if is_resident(experts):
        raise ValueError("experts are already resident")
    if not saved_tensors_hooks_readable():
        saved_tensors_hooks_now()  # raises, saying why
    shapes = expected_shapes(experts)
    if set(tensors) != set(shapes):
        raise ValueError(f"make_resident needs exactly {sorted(shapes)}, got {sorted(tensors)}")
    for name, tensor in tensors.items():
        if tensor.dtype != torch.uint8 or tuple(tensor.shape) != shapes[name]:
            raise ValueError(f"{name}: {tensor.dtype} {tuple(tensor.shape)}, expected uint8 {shapes[name]}")
    if BLOCK_SIZE > experts.hidden_size or experts.hidden_size % BLOCK_SIZE or experts.intermediate_size % BLOCK_SIZE:
        raise ValueError(f"hidden {experts.hidden_size} / intermediate {experts.intermediate_size} are not multiples "
                         f"of the MXFP4 block size {BLOCK_SIZE}")
    for name in PROJECTIONS:
        experts._parameters.pop(name, None)
    for name, tensor in tensors.items():
        experts.register_buffer(name, to_hopper_layout(tensor, _split(name)[1]), persistent=False)
    experts.expert_dtype = dtype
    experts.__class__ = resident_class(type(experts))


def expert_layer_index(name: str) -> int | None:
    """The decoder layer of a module named `...layers.{i}.mlp.experts` (None for other names)."""
    match = _LAYER_RE.search(name)
    return int(match.group(1)) if match else None


def _experts_modules(model) -> list[tuple[int, str, torch.nn.Module]]:
    found = []
    for name, module in model.named_modules():
        index = expert_layer_index(name)
        if index is not None and hasattr(module, "num_experts"):
            found.append((index, name, module))
    return found


def resident_layers(model) -> list[int]:
    """The decoder layers whose experts are resident MXFP4."""
    return sorted(i for i, _, module in _experts_modules(model) if is_resident(module))


class ResidentState(Mapping):
    """The resident blocks and scales by their names in the model (`...mlp.experts.{proj}_{blocks|scales}`, the
    checkpoint's names under the model's prefix), in the checkpoint's layout: what state_dict() leaves out
    (non-persistent buffers). Each tensor is put back in that layout when read (checkpoint_tensor), so iterating
    the names costs nothing."""

    def __init__(self, model):
        self._where = {f"{prefix}.{name}": (module, name) for _, prefix, module in _experts_modules(model)
                       if is_resident(module) for name in expected_shapes(module)}

    def __getitem__(self, key: str) -> torch.Tensor:
        return checkpoint_tensor(*self._where[key])

    def __iter__(self):
        return iter(self._where)

    def __len__(self) -> int:
        return len(self._where)

    def stored(self, key: str) -> torch.Tensor:
        """The buffer itself, in the Hopper layout."""
        module, name = self._where[key]
        return getattr(module, name)


def resident_state(model) -> ResidentState:
    """The resident blocks and scales by their checkpoint names (ResidentState)."""
    return ResidentState(model)


def resident_bytes(model) -> int:
    """Bytes the resident blocks and scales take (the Hopper layout, with its padding)."""
    state = resident_state(model)
    return sum(state.stored(key).nbytes for key in state)


@dataclass
class ResidentSummary:
    """What is resident: layers, bytes, device, and the layers kept as bf16 parameters with the reason."""

    layers: list[int] = field(default_factory=list)
    bytes: int = 0
    device: str = ""
    kept: dict[int, str] = field(default_factory=dict)

    @classmethod
    def of(cls, model, kept: Mapping[int, str] = ()) -> ResidentSummary:
        kept = dict(kept)
        layers = resident_layers(model)
        device = ""
        for _, _, module in _experts_modules(model):
            if is_resident(module):
                device = str(module.gate_up_proj_blocks.device)
                break
        return cls(layers, resident_bytes(model), device, {i: kept[i] for i in sorted(kept) if i not in layers})


def residency_line(summary: ResidentSummary) -> str:
    """One log line: what is resident, its size, where, and which layers keep bf16 experts and why."""
    if summary.layers:
        line = (f"experts: {len(summary.layers)} layer(s) resident as MXFP4 ({summary.bytes / 2**30:.2f} GiB on "
                f"{summary.device}; one layer at a time dequantized while it runs, for training and sampling)")
    else:
        line = "experts: none resident as MXFP4"
    by_reason: dict[str, list[int]] = {}
    for layer, why in summary.kept.items():
        by_reason.setdefault(why, []).append(layer)
    for why, layers in by_reason.items():
        line += f"; layers {layers} keep bf16 experts ({why})"
    return line


def _exact_blocks(param: torch.Tensor, name: str, source: Mapping | None, prefix: str):
    """The checkpoint blocks/scales of an expert parameter [E, in, out]: from `source` when it has them, else
    quantized from the parameter; ValueError unless they dequantize to the parameter bit for bit."""
    blocks_name, scales_name = f"{prefix}.{name}_blocks", f"{prefix}.{name}_scales"
    if source is not None and blocks_name in source and scales_name in source:
        blocks = source[blocks_name].to(param.device)
        scales = source[scales_name].to(param.device)
    else:
        blocks, scales = quantize_mxfp4(param.detach().transpose(-1, -2))
    if not torch.equal(dequantize_experts(blocks, scales, param.dtype), param.detach()):
        raise ValueError(f"{name} is not exactly the MXFP4 values "
                         + ("of the checkpoint's blocks" if source is not None and blocks_name in source
                            else "it would be stored as (not loaded from an MXFP4 checkpoint, or changed since)"))
    return {f"{name}_blocks": blocks, f"{name}_scales": scales}


def make_experts_resident(model, source: Mapping | None = None, keep_bf16_layers: Mapping[int, str] | None = None,
                          say=print) -> ResidentSummary:
    """Turns the bf16 experts of a loaded gpt-oss model resident, layer by layer, freeing each bf16 copy.

    source: the checkpoint's tensors by name (mxfp4_checkpoint.SafetensorsCheckpoint, or a dict), whose
    `model.layers.{i}.mlp.experts.{proj}_{blocks|scales}` are taken as they are; without it (or for a name it lacks)
    the weights are quantized. Either way a layer becomes resident only if the blocks dequantize to its weights bit
    for bit. keep_bf16_layers: {layer: why} left as they are (experts with LoRA). Layers that cannot be converted
    (trainable, LoRA-wrapped, not exactly MXFP4) keep bf16 too; `say` gets residency_line's one line.
    """
    kept = dict(keep_bf16_layers or {})
    for index, name, experts in _experts_modules(model):
        if is_resident(experts) or index in kept:
            continue
        params = [getattr(experts, p, None) for p in PROJECTIONS]
        if not all(isinstance(p, torch.Tensor) and p.dim() == 3 for p in params):
            kept[index] = f"{type(experts).__name__}: no 3-D gate_up_proj/down_proj (LoRA-wrapped?)"
            continue
        if any(p.requires_grad for p in params):
            kept[index] = "their weights are trainable"
            continue
        prefix = re.sub(r"^.*?(model\.layers\.)", r"\1", name)  # checkpoint names start at model.layers
        try:
            tensors = {}
            for proj, param in zip(PROJECTIONS, params, strict=True):
                tensors.update(_exact_blocks(param, proj, source, prefix))
        except ValueError as err:
            kept[index] = str(err)
            continue
        make_resident(experts, tensors, params[0].dtype)
    summary = ResidentSummary.of(model, kept)
    say(residency_line(summary))
    return summary
