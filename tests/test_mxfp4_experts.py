"""mxfp4_experts.py and the resident loader (model_loading.load_resident_model): one MXFP4 copy of the frozen experts
serves training bit for bit like the dequantized load, and no bf16 expert tensor is kept or built.

The tiny MXFP4 checkpoint is loaded both ways (Mxfp4Config(dequantize=True) vs resident) and everything a training
step computes is compared with torch.equal: logits, loss, LoRA gradients, with and without gradient checkpointing,
through transformers' experts and fused_experts.py's (run eagerly on the CPU), and a whole GRPO step through
train_grpo.build_trainer. mxfp4_decode's use of resident layers is tested in test_mxfp4_decode.py.
"""

from __future__ import annotations

import gc
import os
import re
import subprocess
import sys
import weakref
from pathlib import Path

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from tes_grpo.experts import mxfp4_dequant as dq
from tes_grpo.experts import mxfp4_experts as mx
from tes_grpo.model.model_loading import load_training_model, resolve_attention, resolve_experts, resolve_model_path
from tes_grpo.run.script_config import SettingsError
from tes_grpo.training.batch_layout import batch_layout

pytestmark = pytest.mark.usefixtures("one_torch_thread")
# load_training_model loads onto the GPU where there is one (in bf16): these tests then check the GPU's kernels
DEVICE, DTYPE = ("cuda", torch.bfloat16) if torch.cuda.is_available() else ("cpu", torch.float32)


@pytest.fixture(scope="module")
def tiny():
    return resolve_model_path("tiny")


def load(path, experts, dtype=None, expert_lora_layers=(), said=None):
    return load_training_model(path, experts=experts, dtype=dtype, expert_lora_layers=expert_lora_layers,
                               say=(said.append if said is not None else lambda line: None))


# ---------------------------------------------------------------------------------------------------------------
# Dequantization: transformers' values, bit for bit
# ---------------------------------------------------------------------------------------------------------------

def every_byte_and_scale():
    """Blocks [1, 256, 16, 16]: row r has scale r (every E8M0 value, 255 included) and every byte value."""
    blocks = torch.arange(256, dtype=torch.uint8).repeat(256).view(1, 256, 16, 16)
    scales = torch.arange(256, dtype=torch.uint8).view(1, 256, 1).expand(1, 256, 16).contiguous()
    return blocks, scales


def bits(t: torch.Tensor) -> torch.Tensor:
    """The tensor's bit patterns (so signed zeros and infinities compare exactly)."""
    return t.view({2: torch.int16, 4: torch.int32}[t.element_size()])


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_dequantize_equals_transformers_for_every_byte_and_scale(dtype):
    from transformers.integrations.mxfp4 import convert_moe_packed_tensors

    blocks, scales = every_byte_and_scale()
    expected = convert_moe_packed_tensors(blocks, scales, dtype=dtype)  # what Mxfp4Config(dequantize=True) loads
    got = dq.dequantize_experts(blocks, scales, dtype)
    assert got.shape == expected.shape == (1, 512, 256) and got.is_contiguous() and got.dtype == dtype
    assert torch.equal(bits(got), bits(expected))


@pytest.fixture
def kernels():
    """tes_grpo.experts.mxfp4_kernels under Triton's interpreter (compiled again after the test, for the CUDA tests)."""
    pytest.importorskip("triton")
    from triton_interpreter import interpreted

    with interpreted("tes_grpo.experts.mxfp4_kernels") as module:
        yield module


def random_blocks(experts, rows, cols, seed):
    g = torch.Generator().manual_seed(seed)
    return (torch.randint(0, 256, (experts, rows, cols // 32, 16), dtype=torch.uint8, generator=g),
            torch.randint(110, 130, (experts, rows, cols // 32), dtype=torch.uint8, generator=g))


# (layout, weight [E, out, in] or "every" (every_byte_and_scale: 0 and 255 among the scales), the layout's tile,
# dequantization program (rows, columns, warps) or None for its default)
DEQUANTIZE_CASES = [
    ("checkpoint", (3, 96, 160), None, None),  # partial programs both ways
    ("checkpoint", "every", None, None),
    ("tiles", (3, 96, 160), (64, 64), (32, 32, 4)),  # partial tiles both ways: padded, the padding never read back
    ("tiles", (2, 64, 128), (64, 128), (64, 64, 4)),  # whole tiles, a program inside one tile
    ("tiles", "every", (128, 128), (64, 64, 4)),  # mxfp4.TILE
    ("hopper", (3, 96, 160), None, None),  # partial tiles both ways (DEQUANT_HOPPER)
    ("hopper", (2, 256, 256), None, (256, 128, 8)),  # a program over two pieces each way
    ("hopper", (1, 384, 128), None, (256, 128, 8)),  # its second row program reaches past the weight (masked)
    ("hopper", "every", None, None),  # what a resident module keeps
]


@pytest.mark.parametrize("layout, shape, tile, program", DEQUANTIZE_CASES)
def test_dequantize_equals_transformers(layout, shape, tile, program, kernels):
    """The checkpoint's layout, tile order (the decode kernel's tl.dot_scaled copies) and the Hopper layout (what a
    resident module keeps) dequantize to transformers' values bit for bit: the Triton kernel (interpreted; bf16,
    float32 and a converted dtype) and torch's codec."""
    from transformers.integrations.mxfp4 import convert_moe_packed_tensors

    from tes_grpo.experts.mxfp4 import to_hopper_layout, to_tile_order

    blocks, scales = every_byte_and_scale() if shape == "every" else random_blocks(*shape, seed=1)
    rows, cols = blocks.shape[1], blocks.shape[2] * 32
    size = None if layout == "checkpoint" else (rows, cols)
    stored = {"checkpoint": lambda t, part: t, "tiles": lambda t, part: to_tile_order(t, part, tile),
              "hopper": lambda t, part: to_hopper_layout(t, part)}[layout]
    kept = stored(blocks, "blocks"), stored(scales, "scales")
    for dtype in (torch.bfloat16, torch.float32, torch.float16):
        expected = convert_moe_packed_tensors(blocks, scales, dtype=dtype)
        assert torch.equal(bits(dq.dequantize_with_triton(*kept, dtype, program, size=size)), bits(expected))
        assert torch.equal(bits(dq.dequantize_with_torch(*kept, dtype, size=size)), bits(expected))


GUARDED_DEQUANTIZE = """
import sys, torch
from guard_pages import ending_at_a_guard_page
from transformers.integrations.mxfp4 import convert_moe_packed_tensors
from tes_grpo.experts import mxfp4_dequant as dq
from tes_grpo.experts.mxfp4 import quantize_mxfp4, to_hopper_layout
blocks, scales = quantize_mxfp4(torch.randn(1, 300, 128))  # 300 rows padded to 384: three 128-row pieces
kept = [ending_at_a_guard_page(to_hopper_layout(t, part)) for t, part in ((blocks, "blocks"), (scales, "scales"))]
out = dq.dequantize_with_triton(kept[0][0], kept[1][0], torch.bfloat16, (256, 128, 8), size=(300, 128))
sys.exit(0 if torch.equal(out, convert_moe_packed_tensors(blocks, scales, dtype=torch.bfloat16)) else 3)
"""


@pytest.mark.skipif(sys.platform != "linux", reason="the guard page is made with Linux's mmap and mprotect")
def test_dequantizing_the_hopper_layout_reads_nothing_past_the_weights():
    """A 256-row program over a weight padded to 384 rows: its second piece reaches 128 rows past the stored bytes.
    With the stored bytes ending at a page the process cannot read, an unmasked load would fault (in a child process,
    so a fault fails this test instead of ending the run)."""
    pytest.importorskip("triton")
    tests = Path(__file__).resolve().parent
    paths = [str(tests), str(tests.parent)] + ([os.environ["PYTHONPATH"]] if os.environ.get("PYTHONPATH") else [])
    env = {**os.environ, "TRITON_INTERPRET": "1", "PYTHONPATH": os.pathsep.join(paths)}
    result = subprocess.run([sys.executable, "-c", GUARDED_DEQUANTIZE], env=env, capture_output=True, text=True,
                            timeout=300)
    assert result.returncode == 0, f"exit {result.returncode}: {result.stderr[-2000:]}"


# (name, what is stored, words of the error)
PUT_CASES = [
    ("gate_up_proj_blocks", torch.zeros(4, 128, 2, 16, dtype=torch.uint8), None),  # the checkpoint's shape: stored
    ("gate_up_proj_bias", torch.zeros(4, 128, dtype=torch.uint8), "is none of"),  # not a blocks or scales name
    ("down_proj_scales", torch.zeros(4, 64, 3, dtype=torch.uint8), "expected uint8 (4, 64, 2)"),  # wrong shape
    ("down_proj_scales", torch.zeros(4, 64, 2, dtype=torch.int8), "torch.int8"),  # wrong dtype
]


@pytest.mark.parametrize("name, tensor, words", PUT_CASES)
def test_put_checkpoint_tensor(tiny, name, tensor, words):
    from tes_grpo.experts.mxfp4 import to_hopper_layout

    experts = load(tiny, "mxfp4").model.layers[0].mlp.experts
    if words is None:
        mx.put_checkpoint_tensor(experts, name, tensor.clone().fill_(7))
        assert torch.equal(getattr(experts, name), to_hopper_layout(tensor.fill_(7), "blocks"))
        assert torch.equal(mx.checkpoint_tensor(experts, name), tensor)
    else:
        with pytest.raises(ValueError, match=re.escape(words)):
            mx.put_checkpoint_tensor(experts, name, tensor)


def test_loader_names_the_checkpoint_tensor_a_resident_module_refuses(tiny):
    from tes_grpo.model.model_loading import _place

    experts = load(tiny, "mxfp4").model.layers[1].mlp.experts
    name = "model.layers.1.mlp.experts.down_proj_scales"
    with pytest.raises(ValueError, match=re.escape(f"checkpoint tensor {name}: down_proj_scales: torch.uint8 "
                                                   "(4, 64, 3), expected uint8 (4, 64, 2)")):
        _place(experts, "down_proj_scales", torch.zeros(4, 64, 3, dtype=torch.uint8), "cpu", name)


def test_dequantize_refuses_what_is_not_a_layout_it_reads():
    from tes_grpo.experts.mxfp4 import to_hopper_layout

    blocks, scales = every_byte_and_scale()
    with pytest.raises(ValueError, match="not a \\[E, 256, 512\\] weight in tile order"):
        dq.dequantize_experts(blocks, scales, torch.float32, size=(256, 512))  # the checkpoint's layout, size given
    with pytest.raises(ValueError, match="not the checkpoint's"):
        dq.dequantize_experts(blocks[..., :8], scales, torch.float32)
    stored = to_hopper_layout(blocks, "blocks"), to_hopper_layout(scales, "scales")
    with pytest.raises(ValueError, match="not a \\[E, 256, 384\\] weight in the Hopper layout"):
        dq.dequantize_experts(*stored, torch.float32, size=(256, 384))  # the inputs padded past one tile
    with pytest.raises(ValueError, match="pieces of 128 rows and 64 columns"):
        dq.dequantize_with_triton(*stored, torch.float32, program=(64, 64, 4), size=(256, 512))


# ---------------------------------------------------------------------------------------------------------------
# Training: resident = dequantized load, bit for bit
# ---------------------------------------------------------------------------------------------------------------

def lora_pass(path, experts, dtype, checkpointing, fused, expert_layers=()):
    """One forward/backward of the tiny model with LoRA (B != 0, same init every time): logits, loss, LoRA grads, and
    the resident layers."""
    from peft import get_peft_model

    from tes_grpo.experts.fused_experts import use_fused_experts
    from train_grpo import build_lora_config

    model = load(path, experts, dtype, expert_layers)
    resident = mx.resident_layers(model)
    torch.manual_seed(0)
    config = build_lora_config(4, 8, expert_layers)
    config.init_lora_weights = False
    model = get_peft_model(model, config)
    if checkpointing:  # as TRL sets it up
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        model.enable_input_require_grads()
    model.train()
    if fused:
        assert use_fused_experts(model, say=pytest.fail) == 2
    ids = torch.randint(0, 201088, (2, 13), generator=torch.Generator().manual_seed(4)).to(DEVICE)
    out = model(input_ids=ids, labels=ids)
    out.loss.backward()
    grads = {n: p.grad for n, p in model.named_parameters() if p.requires_grad}
    return out.logits.detach(), out.loss.detach(), grads, resident


# (dtype, gradient checkpointing, fused_experts' training forward, layers with LoRA on their experts, resident layers)
TRAINING_CASES = [
    (None, False, False, (), [0, 1]),  # the device's dtype (CPU: float32), transformers' grouped_mm experts
    (None, True, False, (), [0, 1]),  # gradient checkpointing (non-reentrant, as TRL asks): recomputed forward
    (None, False, True, (), [0, 1]),  # fused_experts.py's Functions, eagerly
    (None, True, True, (), [0, 1]),
    (torch.bfloat16, True, True, (), [0, 1]),  # the GPU's dtype
    (None, True, False, (1,), [0]),  # layer 1's experts carry LoRA: bf16 there, resident in layer 0
]


@pytest.mark.parametrize("dtype, checkpointing, fused, expert_layers, resident", TRAINING_CASES)
def test_training_pass_is_bit_exact(tiny, dtype, checkpointing, fused, expert_layers, resident):
    logits_a, loss_a, grads_a, none = lora_pass(tiny, "bf16", dtype, checkpointing, fused, expert_layers)
    logits_b, loss_b, grads_b, layers = lora_pass(tiny, "mxfp4", dtype, checkpointing, fused, expert_layers)
    assert none == [] and layers == resident
    assert torch.equal(logits_a, logits_b) and torch.equal(loss_a, loss_b)
    assert grads_a.keys() == grads_b.keys() and len(grads_a) == 16 + 4 * len(expert_layers)
    for name in grads_a:
        assert torch.equal(grads_a[name], grads_b[name]), name


def resident_lora_model(path, checkpointing: bool):
    """The tiny model with resident experts and the recipe's LoRA, in train mode, and a batch of ids for it."""
    from peft import get_peft_model

    from train_grpo import build_lora_config

    model = get_peft_model(load(path, "mxfp4"), build_lora_config(4, 8))
    if checkpointing:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        model.enable_input_require_grads()
    model.train()
    return model, torch.randint(0, 201088, (2, 9), generator=torch.Generator().manual_seed(1)).to(DEVICE)


@pytest.mark.parametrize("checkpointing, calls", [
    (False, 4),  # forward, then the backward's own dequantization: 2 layers x 2 projections x 2
    (True, 6),  # + checkpointing's recomputed forward
])
def test_dequantized_weights_live_only_while_their_layer_runs(tiny, checkpointing, calls, monkeypatch):
    """Between forward and backward no dequantized weight is alive (autograd keeps a handle, not the weight)."""
    made = []
    real = mx.ResidentMxfp4Experts.dequantize

    def dequantize(self, name):
        weight = real(self, name)
        made.append(weakref.ref(weight))
        return weight

    monkeypatch.setattr(mx.ResidentMxfp4Experts, "dequantize", dequantize)
    model, ids = resident_lora_model(tiny, checkpointing)
    loss = model(input_ids=ids, labels=ids).loss
    gc.collect()
    assert len(made) == 2 * 2 and not any(ref() is not None for ref in made)
    loss.backward()
    gc.collect()
    assert len(made) == 2 * calls and not any(ref() is not None for ref in made)


@pytest.mark.parametrize("checkpointing", [True, False])
def test_a_training_pass_leaves_no_tensor_in_a_reference_cycle(tiny, checkpointing):
    """Refcounting alone must free a pass's activations: Python's cyclic collector runs by object counts, not GPU
    memory, so a tensor held in a cycle (a call's hooks hold checkpointing's, which hold the layer's frame) stays on
    the GPU for an unknown time; on an H100 such a cycle ran GRPO out of memory at its second step. Compiling (flex
    attention on a GPU) leaves FakeTensors in cycles: metadata of no memory, not counted."""
    from torch._subclasses.fake_tensor import FakeTensor

    model, ids = resident_lora_model(tiny, checkpointing)
    gc.collect()
    gc.disable()
    try:
        model(input_ids=ids, labels=ids).loss.backward()
        gc.set_debug(gc.DEBUG_SAVEALL)
        gc.collect()
        cycled = [o for o in gc.garbage if isinstance(o, torch.Tensor) and not isinstance(o, FakeTensor)]
    finally:
        gc.set_debug(0)
        gc.garbage.clear()
        gc.enable()
    assert cycled == []


def test_other_saved_tensors_go_to_the_hooks_outside(monkeypatch):
    """Inside a call, the saved tensors that are not the weights reach the hooks active around it (gradient
    checkpointing's, or torch.autograd.graph.save_on_cpu's): innermost hooks would otherwise shadow them."""
    import copy

    from transformers import GptOssConfig
    from transformers.models.gpt_oss.modeling_gpt_oss import GptOssExperts

    config = GptOssConfig(hidden_size=64, intermediate_size=32, num_local_experts=4, num_experts_per_tok=2)
    config._experts_implementation = "grouped_mm"
    torch.manual_seed(0)
    experts = GptOssExperts(config).requires_grad_(False)
    with torch.no_grad():
        for param in experts.parameters():
            param.normal_(0, 0.1)
        for name in mx.PROJECTIONS:  # values on the MXFP4 grid, as loaded from a checkpoint
            weight = getattr(experts, name)
            weight.copy_(dq.dequantize_experts(*mx.quantize_mxfp4(weight.transpose(-1, -2)), torch.float32))
    plain = copy.deepcopy(experts)
    layers = torch.nn.ModuleDict({"layers": torch.nn.ModuleList([torch.nn.ModuleDict({"mlp": torch.nn.ModuleDict(
        {"experts": experts})})])})
    assert mx.make_experts_resident(layers, say=lambda line: None).layers == [0] and mx.is_resident(experts)
    weights_at = []
    real = mx.ResidentMxfp4Experts.dequantize
    monkeypatch.setattr(mx.ResidentMxfp4Experts, "dequantize",
                        lambda self, name: weights_at.append(t := real(self, name)) or t)
    hidden = torch.randn(7, 64, requires_grad=True)
    index = torch.randint(0, 4, (7, 2), generator=torch.Generator().manual_seed(1))
    routing = torch.rand(7, 2)
    outside = []
    with torch.autograd.graph.saved_tensors_hooks(lambda t: outside.append(t.untyped_storage().data_ptr()) or t,
                                                  lambda t: t):
        out = experts(hidden, index, routing)
        assert len(weights_at) == 2
        weight_ptrs = {w.untyped_storage().data_ptr() for w in weights_at}
    assert outside and not weight_ptrs & set(outside)  # activations went out, the weights stayed as handles
    out.sum().backward()
    assert len(weights_at) == 4  # dequantized again for the backward
    again = hidden.detach().requires_grad_()
    expected = plain(again, index, routing)
    expected.sum().backward()
    assert torch.equal(out.detach(), expected.detach()) and torch.equal(hidden.grad, again.grad)


# ---------------------------------------------------------------------------------------------------------------
# The loader: no bf16 expert tensor, everything else as from_pretrained gives it
# ---------------------------------------------------------------------------------------------------------------

class FloatShapes(TorchDispatchMode):
    """Records the shape of every floating-point tensor with storage an op creates (meta tensors have none)."""

    def __init__(self):
        super().__init__()
        self.shapes = set()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in out if isinstance(out, (tuple, list)) else (out,):
            if isinstance(t, torch.Tensor) and t.is_floating_point() and not t.is_meta:
                self.shapes.add(tuple(t.shape))
        return out


@pytest.mark.parametrize("dtype", [None, torch.bfloat16])
def test_loader_builds_no_bf16_expert_and_matches_from_pretrained(tiny, dtype):
    from tes_grpo.experts.mxfp4 import padded_bytes, to_hopper_layout
    from tes_grpo.experts.mxfp4_checkpoint import SafetensorsCheckpoint

    said = []
    with FloatShapes() as created:
        model = load(tiny, "mxfp4", dtype, said=said)
    reference = load(tiny, "bf16", dtype)
    e, h, i = 4, 64, 64  # the tiny model's experts, hidden, intermediate
    expert_shapes = {(e, h, 2 * i), (e, i, h), (h, 2 * i), (i, h), (2 * i, h), (h, i), (e, 2 * i, h), (e, h, i)}
    assert not created.shapes & expert_shapes  # not even one expert's weight was built in a float dtype
    checkpoint = SafetensorsCheckpoint(tiny)
    state, expected = model.state_dict(), reference.state_dict()
    assert not set(mx.resident_state(model)) & set(state)  # non-persistent buffers: in no checkpoint or adapter save
    for name, tensor in {**state, **mx.resident_state(model)}.items():
        assert tensor.device.type == DEVICE
        if name.endswith(("_blocks", "_scales")):  # the checkpoint's bytes, nothing else, for the experts
            assert tensor.dtype == torch.uint8 and torch.equal(tensor.cpu(), checkpoint[name]), name
        else:
            assert tensor.dtype == expected[name].dtype and torch.equal(tensor, expected[name]), name
    assert not any(n.endswith(("experts.gate_up_proj", "experts.down_proj")) for n in state)
    assert set(expected) - set(state) == {f"model.layers.{j}.mlp.experts.{p}" for j in (0, 1) for p in mx.PROJECTIONS}
    for j, layer in enumerate(model.model.layers):
        for name in mx.PROJECTIONS:  # the properties give the dequantized load's tensors: values, layout, dtype
            ours, theirs = getattr(layer.mlp.experts, name), getattr(reference.model.layers[j].mlp.experts, name)
            assert (ours.shape, ours.stride(), ours.dtype) == (theirs.shape, theirs.stride(), theirs.dtype)
            assert torch.equal(ours, theirs)
    for name, buffer in reference.named_buffers():
        assert torch.equal(dict(model.named_buffers())[name], buffer)
    assert model.config.to_dict() == reference.config.to_dict()
    assert model.generation_config.to_dict() == reference.generation_config.to_dict()
    assert (model.training, model.name_or_path, model.config._attn_implementation,
            model.config._experts_implementation) == (False, reference.name_or_path,
                                                      resolve_attention("auto", DEVICE), "grouped_mm")
    resident = mx.resident_state(model)
    for name in resident:  # kept in the Hopper layout, the order the decode kernel reads
        assert torch.equal(resident.stored(name).cpu(), to_hopper_layout(checkpoint[name], name.rpartition("_")[2]))
    # each of the 2 layers' 4 experts: gate_up [128, 64] and down [64, 64] (out, in), each padded to one tile
    assert mx.resident_bytes(model) == 2 * 4 * (padded_bytes(2 * i, h) + padded_bytes(h, i)) == 139264
    assert any(line.startswith("experts: 2 layer(s) resident as MXFP4") for line in said)


# (EXPERTS, layers with expert LoRA, resident layers, words of the log)
CHOICES = [
    ("auto", (), [0, 1], "EXPERTS=auto: MXFP4 checkpoint, no LoRA on the experts"),
    ("auto", (1,), [], "EXPERTS=auto: LoRA on the experts of layers [1], so all experts dequantized"),
    ("mxfp4", (1,), [0], "layers [1] keep bf16 experts (LoRA on their experts: LORA_EXPERT_LAYERS)"),
    ("bf16", (), [], "Mxfp4Config(dequantize=True)"),
]


@pytest.mark.parametrize("experts, expert_layers, resident, words", CHOICES)
def test_experts_choice_and_what_the_log_says(tiny, experts, expert_layers, resident, words):
    said = []
    model = load(tiny, experts, expert_lora_layers=expert_layers, said=said)
    assert mx.resident_layers(model) == resident
    assert any(words in line for line in said), said
    for j in expert_layers:  # LoRA's layers: ordinary parameters, PEFT's target_parameters can adapt them
        params = dict(model.model.layers[j].mlp.experts.named_parameters())
        assert params["gate_up_proj"].dtype == DTYPE and "gate_up_proj_blocks" not in params


def test_bad_experts_choices(tiny, tmp_path):
    from transformers import GptOssConfig

    with pytest.raises(SettingsError, match="EXPERTS='int4': must be one of auto, mxfp4, bf16"):
        resolve_experts("int4", tiny)
    GptOssConfig(hidden_size=64, intermediate_size=64, num_hidden_layers=1).save_pretrained(tmp_path)  # bf16
    assert resolve_experts("auto", str(tmp_path)) == ("bf16", "EXPERTS=auto: the checkpoint is not MXFP4")
    with pytest.raises(SettingsError, match="EXPERTS=mxfp4 needs an MXFP4 checkpoint"):
        resolve_experts("mxfp4", str(tmp_path))


def test_peft_adapter_loads_on_the_resident_model(tiny, tmp_path):
    """What an evaluation script does: the loader, then PeftModel.from_pretrained with a saved adapter."""
    from peft import PeftModel, get_peft_model

    from train_grpo import build_lora_config

    torch.manual_seed(0)
    config = build_lora_config(4, 8)
    config.init_lora_weights = False
    get_peft_model(load(tiny, "bf16"), config).save_pretrained(tmp_path)
    ids = torch.randint(0, 201088, (2, 11), generator=torch.Generator().manual_seed(2)).to(DEVICE)
    logits = {}
    for experts in ("bf16", "mxfp4"):
        model = PeftModel.from_pretrained(load(tiny, experts), str(tmp_path))
        assert mx.resident_layers(model) == ([0, 1] if experts == "mxfp4" else [])
        with torch.no_grad():
            logits[experts] = model(input_ids=ids).logits
    assert torch.equal(logits["bf16"], logits["mxfp4"])


def test_dtype_changes_follow_to():
    """model.to(dtype) changes what the experts dequantize to, as it would change their parameters."""
    from tes_grpo.model.gpt_oss_shapes import build_random_model

    model = build_random_model("eager", "cpu", resident=True, dtype=torch.float32, **SMALL)
    experts = model.model.layers[0].mlp.experts
    assert experts.gate_up_proj.dtype == torch.float32
    model.to(torch.bfloat16)
    assert experts.gate_up_proj.dtype == torch.bfloat16 and experts.gate_up_proj_blocks.dtype == torch.uint8


# ---------------------------------------------------------------------------------------------------------------
# gpt-oss-120b's shapes
# ---------------------------------------------------------------------------------------------------------------

SMALL = dict(num_hidden_layers=2, hidden_size=64, intermediate_size=64, vocab_size=1024, pad_token_id=5,
             eos_token_id=3, bos_token_id=1)


def test_120b_config_is_openais():
    from tes_grpo.model.gpt_oss_shapes import gpt_oss_120b_config

    c = gpt_oss_120b_config()
    assert (c.num_hidden_layers, c.num_local_experts, c.num_experts_per_tok, c.hidden_size, c.intermediate_size,
            c.num_attention_heads, c.num_key_value_heads, c.head_dim, c.sliding_window, c.vocab_size) == (
        36, 128, 4, 2880, 2880, 64, 8, 64, 128, 201088)
    assert c.layer_types == ["sliding_attention", "full_attention"] * 18
    assert c.rope_parameters["rope_type"] == "yarn" and c.rope_parameters["factor"] == 32.0
    assert c.rope_parameters["rope_theta"] == 150000.0


def test_120b_shaped_model_builds_resident_and_trains_one_step():
    """128 experts of 4 per token at a reduced width and depth: experts as MXFP4 blocks only, one LoRA step."""
    from peft import get_peft_model
    from transformers import GptOssForCausalLM

    from tes_grpo.model.gpt_oss_shapes import build_random_model, gpt_oss_config
    from train_grpo import build_lora_config

    with FloatShapes() as created:
        model = build_random_model("eager", "cpu", size="120b", resident=True, dtype=torch.float32, **SMALL)
    assert not created.shapes & {(128, 64, 128), (128, 64, 64), (64, 128), (64, 64)}  # no float expert weight
    assert mx.resident_layers(model) == [0, 1] and model.config.num_local_experts == 128
    reference = GptOssForCausalLM(gpt_oss_config("120b", **SMALL))
    for name, buffer in reference.named_buffers():  # the rotary frequencies, as an ordinary build computes them
        assert torch.equal(dict(model.named_buffers())[name], buffer), name
    blocks = model.model.layers[0].mlp.experts.gate_up_proj_blocks.clone()
    model = get_peft_model(model, build_lora_config(4, 8))
    model.train()
    trainable = [p for p in model.parameters() if p.requires_grad]
    before = [p.detach().clone() for p in trainable]
    optimizer = torch.optim.AdamW(trainable, lr=1e-3)
    ids = torch.randint(0, 1024, (2, 16), generator=torch.Generator().manual_seed(0))
    loss = model(input_ids=ids, labels=ids).loss
    loss.backward()
    optimizer.step()
    assert torch.isfinite(loss)
    assert any(not torch.equal(a, p) for a, p in zip(before, trainable, strict=True))
    assert torch.equal(model.base_model.model.model.layers[0].mlp.experts.gate_up_proj_blocks, blocks)


# ---------------------------------------------------------------------------------------------------------------
# A whole GRPO step through train_grpo
# ---------------------------------------------------------------------------------------------------------------

@pytest.mark.slow
def test_grpo_step_is_bit_exact(tiny, tmp_path, tokenizer):
    """train_grpo.build_trainer(...).train() for one step, both ways: same completions, the training forward's
    per-token log-probabilities, loss, LoRA gradients and trained adapter, bit for bit. The completions are long enough
    for the tiny model's answers (valid ones score differently, so the advantages and the gradients are not zero)."""
    from grpo_fixtures import write_fixture_data
    from transformers import TrainerCallback

    import train_grpo

    class Gradients(TrainerCallback):
        def __init__(self):
            self.seen = []

        def on_pre_optimizer_step(self, args, state, control, model=None, **kwargs):
            self.seen.append({n: p.grad.detach().clone() for n, p in model.named_parameters() if "lora_" in n})

    data = write_fixture_data(tmp_path, tokenizer)
    results = {}
    for experts in ("bf16", "mxfp4"):
        settings = train_grpo.default_settings(
            MODEL_ID="tiny", DATA_DIR=str(data), EVAL_DIR=str(data / "eval"), OUT_DIR=str(tmp_path / experts),
            TOTAL_STEPS=1, NUM_GENERATIONS=4, GRADIENT_ACCUMULATION_STEPS=1, MAX_COMPLETION_LEN=48,
            GRADIENT_CHECKPOINTING=True, TRAIN_EXPERTS="fused")
        frame = train_grpo.load_training_data(settings, tokenizer)
        layout = batch_layout(settings, int(frame["prompt_tokens"].max()))
        model = load(tiny, experts)
        assert mx.resident_layers(model) == ([0, 1] if experts == "mxfp4" else [])
        torch.manual_seed(0)
        gradients = Gradients()
        trainer = train_grpo.build_trainer(settings, model, tokenizer,
                                           train_grpo.build_stream(frame, settings).to_iterable_dataset(), layout,
                                           callbacks=[gradients])
        seen, logps = [], []
        compute_loss, per_token_logps = trainer.compute_loss, trainer._get_per_token_logps_and_entropies

        def record(model, inputs, *args, compute_loss=compute_loss, seen=seen, **kwargs):
            loss = compute_loss(model, inputs, *args, **kwargs)
            seen.append((inputs["completion_ids"].clone(), inputs["advantages"].clone(), loss.detach().clone()))
            return loss

        def record_logps(*args, per_token_logps=per_token_logps, logps=logps, **kwargs):
            out = per_token_logps(*args, **kwargs)
            logps.append(out[0].detach().clone())
            return out

        trainer.compute_loss = record
        trainer._get_per_token_logps_and_entropies = record_logps
        trainer.train()
        lora = {n: p.detach().clone() for n, p in trainer.model.named_parameters() if "lora_" in n}
        results[experts] = (seen, logps, gradients.seen, lora)
    (seen_a, logps_a, grads_a, lora_a), (seen_b, logps_b, grads_b, lora_b) = results["bf16"], results["mxfp4"]
    assert len(seen_a) == len(seen_b) == 1
    for a, b in zip(seen_a[0], seen_b[0], strict=True):  # completions, advantages, loss
        assert torch.equal(a, b)
    assert seen_a[0][1].abs().max() > 0  # rewards differed within the group: the step has something to learn
    assert logps_a and len(logps_a) == len(logps_b)
    for a, b in zip(logps_a, logps_b, strict=True):
        assert torch.equal(a, b)
    assert len(grads_a) == len(grads_b) == 1 and grads_a[0].keys() == lora_a.keys()
    assert any(g.abs().max() > 0 for g in grads_a[0].values())
    for name in grads_a[0]:
        assert torch.equal(grads_a[0][name], grads_b[0][name]), name
    assert lora_a.keys() == lora_b.keys() and lora_a
    for name in lora_a:
        assert torch.equal(lora_a[name], lora_b[name]), name
