"""tes_grpo/patches/: every library patch is registered with the versions it was checked on, and the installed
libraries' patched functions still have a fingerprint it was checked on (a new release that changes one fails here,
naming the patch to re-check); the whole package is scanned (tests/package_scan.py) for code that names a library
version, assigns into a library or binds a method on an object outside the registry; TensorBoard after a resume keeps
one point per step; flex attention's masks from padding bounds are transformers' masks; the process group is left
once."""

from __future__ import annotations

import importlib
import importlib.metadata
import inspect
import re
from pathlib import Path
from types import SimpleNamespace

import pytest


def tensorboard_steps(log_dir) -> list[int]:
    """The steps of train/reward's points, sorted (two event files written in the same second load in either
    order)."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    events = EventAccumulator(str(log_dir), purge_orphaned_data=True)
    events.Reload()
    return sorted(event.step for event in events.Scalars("train/reward"))


def fake_trainer(log_dir):
    from transformers.integrations import TensorBoardCallback

    callback = TensorBoardCallback()
    return SimpleNamespace(callback_handler=SimpleNamespace(callbacks=[callback]), is_world_process_zero=lambda: True,
                           callback=callback)


def log_steps(trainer, steps) -> None:
    state = SimpleNamespace(is_world_process_zero=True, is_hyper_param_search=False, global_step=0)
    args = SimpleNamespace(output_dir="unused", to_json_string=lambda: "{}")
    trainer.callback.on_train_begin(args, state, None)
    for step in steps:
        state.global_step = step
        trainer.callback.on_log(args, state, None, logs={"reward": 0.1 * step})
    trainer.callback.tb_writer.close()


# (steps of the first run, checkpoint step resumed from, steps of the resumed run)
RESUMES = [
    (range(1, 21), 10, range(11, 13)),  # killed after step 20, resumed from 10 to 12: 13..20 must disappear
    (range(1, 6), 5, range(6, 9)),  # resumed from the last step: nothing redone
]


@pytest.mark.parametrize("first, checkpoint, resumed", RESUMES)
def test_resumed_run_leaves_one_tensorboard_point_per_step(tmp_path, first, checkpoint, resumed):
    from tes_grpo.patches.transformers_patches import point_tensorboard

    log_dir = tmp_path / "tensorboard"
    trainer = fake_trainer(log_dir)
    assert point_tensorboard(trainer, log_dir)
    log_steps(trainer, first)
    again = fake_trainer(log_dir)
    assert point_tensorboard(again, log_dir, resume_step=checkpoint)
    log_steps(again, resumed)
    assert tensorboard_steps(log_dir) == list(range(1, checkpoint + 1)) + list(resumed)


def test_without_purge_step_the_redone_steps_are_doubled(tmp_path):
    # what transformers does by itself (the behaviour the workaround exists for)
    from tes_grpo.patches.transformers_patches import point_tensorboard

    log_dir = tmp_path / "tensorboard"
    for steps in (range(1, 5), range(3, 5)):
        trainer = fake_trainer(log_dir)
        point_tensorboard(trainer, log_dir)
        log_steps(trainer, steps)
    assert tensorboard_steps(log_dir) == [1, 2, 3, 3, 4, 4]


# ---------------------------------------------------------------------------------------------------------------
# flex attention masks: padding written as each row's bounds gives transformers' mask
# ---------------------------------------------------------------------------------------------------------------

# (a row of the 2-D attention mask, (start, end) or None)
BOUNDS = [
    ([1, 1, 1, 1], (0, 4)),  # no padding
    ([0, 0, 1, 1], (2, 4)),  # TRL's left-padded prompt
    ([1, 1, 1, 0], (0, 3)),  # a completion right-padded after its end
    ([0, 1, 1, 0], (1, 3)),  # both
    ([0, 0, 0, 0], (0, 0)),  # nothing to attend to
    ([1, 0, 1, 1], None),  # a hole: not one run
    ([0, 1, 0, 1], None),
]


@pytest.mark.parametrize("row, expected", BOUNDS)
def test_padding_bounds(row, expected):
    import torch

    from tes_grpo.patches.transformers_patches import padding_bounds

    got = padding_bounds(torch.tensor([row, [1, 1, 1, 1]]))
    assert (got if got is None else (int(got[0][0]), int(got[1][0]))) == expected


def flex_block_mask(monkeypatch, wrapped: bool, attention_mask, sliding: int | None, q_length: int, q_offset: int,
                    kv_offset: int | None = None, kv_length: int | None = None):
    """The BlockMask flex attention would get from transformers' flex_attention_mask (wrapped or not), with
    create_block_mask run eagerly (transformers compiles it; the same mask, without the wait). attention_mask None:
    2 rows without one. kv_offset defaults to q_offset, kv_length to the keys from kv_offset to the mask's end (or
    the last query). The tests call the mask function with the 0/1 int64 mask TRL makes, which transformers' own
    lookup keeps as int64 here (a model's forward casts it to bool first), and eager create_block_mask refuses an
    int64 mask: the mask function it gets answers in bool."""
    import torch
    import transformers.masking_utils as mu
    from torch.nn.attention.flex_attention import create_block_mask

    from tes_grpo.patches.transformers_patches import FlexMaskWithPaddingBounds

    monkeypatch.setattr(mu, "create_block_mask", lambda mask_mod, *args, _compile=False, **kwargs: create_block_mask(
        lambda b, h, q, kv: mask_mod(b, h, q, kv).bool(), *args, **kwargs))
    function = FlexMaskWithPaddingBounds(mu.flex_attention_mask) if wrapped else mu.flex_attention_mask
    mask_function = mu.sliding_window_causal_mask_function(sliding) if sliding else mu.causal_mask_function
    rows, length = (2, q_offset + q_length) if attention_mask is None else attention_mask.shape
    kv_offset = q_offset if kv_offset is None else kv_offset
    kv_length = length - kv_offset if kv_length is None else kv_length
    return function(batch_size=rows, q_length=q_length, kv_length=kv_length, q_offset=q_offset, kv_offset=kv_offset,
                    mask_function=mask_function, attention_mask=attention_mask, local_size=sliding, device="cpu",
                    dtype=torch.bfloat16)


def assert_same_block_mask(ours, theirs, rows: int, q_length: int, kv_length: int):
    """The same block lists, the same positions seen (each mask function evaluated everywhere), some but not all."""
    import torch
    from torch.nn.attention.flex_attention import create_mask

    assert ours.shape == theirs.shape == (rows, 1, q_length, kv_length)
    assert ours.BLOCK_SIZE == theirs.BLOCK_SIZE
    for field in ("kv_num_blocks", "kv_indices", "full_kv_num_blocks", "full_kv_indices", "q_num_blocks",
                  "q_indices", "full_q_num_blocks", "full_q_indices"):
        assert torch.equal(getattr(ours, field), getattr(theirs, field)), field
    dense = create_mask(ours.mask_mod, rows, 1, q_length, kv_length, device="cpu")
    assert torch.equal(dense, create_mask(theirs.mask_mod, rows, 1, q_length, kv_length, device="cpu"))
    assert torch.equal(ours.to_dense(), theirs.to_dense())
    assert dense.any() and not dense.all()


def rows_padded(length: int, *bounds: tuple[int, int]) -> list[list[int]]:
    """Rows of a 0/1 attention mask of `length` with ones over each [start, end)."""
    return [[int(start <= k < end) for k in range(length)] for start, end in bounds]


# (rows of the attention mask or None for none, sliding window or None, query length, query offset)
FLEX_MASKS = [
    ([[0, 0, 0, 1, 1, 1, 1, 1, 1, 1], [1] * 10], None, 10, 0),  # TRL: left-padded prompts, a training forward
    ([[0, 0, 1, 1, 1, 1, 1, 1, 0, 0], [0, 1, 1, 1, 1, 1, 1, 1, 1, 1]], 3, 10, 0),  # right padding, sliding window
    ([[0, 0, 1, 1, 1, 1, 1, 1, 1, 1], [1] * 10], 4, 2, 8),  # the last 2 positions after 8 cached (offsets)
    ([[1, 1, 0, 1, 1, 1, 1, 1, 1, 1], [1] * 10], None, 10, 0),  # a hole: transformers' own lookup
    ([[0] * 10, [1] * 10], None, 10, 0),  # a row with nothing to attend to
    (rows_padded(300, (40, 300), (0, 200), (130, 257)), None, 300, 0),  # several blocks, the last one cut
    (rows_padded(300, (40, 300), (0, 200), (130, 257)), 128, 300, 0),  # gpt-oss's window over several blocks
    (rows_padded(384, (0, 384), (128, 256), (0, 0)), 128, 384, 0),  # whole blocks: full ones exist, bounds on edges
    (rows_padded(384, (5, 384), (0, 383)), 200, 384, 0),  # a window wider than a block
    (rows_padded(400, (17, 400), (0, 390)), 128, 150, 250),  # 150 queries after 250 cached: offsets across blocks
    (rows_padded(260, (1, 260), (0, 259)), 1, 260, 0),  # a window of one: the diagonal only
    ([[1] * 300] * 2, None, 300, 0),  # no padding: the same mask, still without create_block_mask
    ([[1] * 300] * 2, 128, 300, 0),
    (None, None, 300, 0),  # no mask at all (one sequence, or a caller that pads nothing)
    (None, 128, 150, 250),
]


@pytest.mark.parametrize("rows, sliding, q_length, q_offset", FLEX_MASKS)
def test_bounded_flex_mask_is_transformers_mask(monkeypatch, rows, sliding, q_length, q_offset):
    """The wrapper's block mask (worked out from the bounds, or transformers' for a hole) is transformers' own."""
    import torch

    attention_mask = None if rows is None else torch.tensor(rows)
    ours = flex_block_mask(monkeypatch, True, attention_mask, sliding, q_length, q_offset)
    theirs = flex_block_mask(monkeypatch, False, attention_mask, sliding, q_length, q_offset)
    rows = rows or [[1] * (q_offset + q_length)] * 2
    assert_same_block_mask(ours, theirs, len(rows), q_length, len(rows[0]) - q_offset)


# (rows of the attention mask, sliding window or None, query length, query offset, key offset, key length): calls
# with a cache, where the keys start elsewhere than the queries
FLEX_MASKS_CACHED = [
    (rows_padded(400, (17, 400), (0, 390)), None, 150, 250, 0, 400),  # a full layer: every key from the first
    (rows_padded(400, (17, 400), (0, 390)), 128, 150, 250, 123, 277),  # a sliding layer: the window's keys only
    (rows_padded(400, (17, 400), (130, 400)), 128, 150, 250, 123, 277),  # a row's first key inside the window
    (rows_padded(400, (17, 400), (0, 390)), None, 150, 250, 0, 512),  # a static cache longer than the mask
    (rows_padded(300, (5, 300), (0, 300)), 200, 1, 299, 0, 300),  # one decode step's query
]


@pytest.mark.parametrize("rows, sliding, q_length, q_offset, kv_offset, kv_length", FLEX_MASKS_CACHED)
def test_bounded_flex_mask_with_a_cache_is_transformers_mask(monkeypatch, rows, sliding, q_length, q_offset,
                                                              kv_offset, kv_length):
    """The same with the keys' offset and length apart from the queries', as with a cache."""
    import torch

    attention_mask = torch.tensor(rows)
    ours, theirs = (flex_block_mask(monkeypatch, wrapped, attention_mask, sliding, q_length, q_offset, kv_offset,
                                    kv_length) for wrapped in (True, False))
    assert_same_block_mask(ours, theirs, len(rows), q_length, kv_length)


def test_bounded_block_mask_needs_no_create_block_mask(monkeypatch):
    """gpt-oss's two masks, padded, are built without create_block_mask (compiled, in transformers)."""
    import torch
    import transformers.masking_utils as mu

    from tes_grpo.patches.transformers_patches import FlexMaskWithPaddingBounds

    def refuse(*args, **kwargs):
        raise AssertionError("create_block_mask called")

    monkeypatch.setattr(mu, "create_block_mask", refuse)
    function = FlexMaskWithPaddingBounds(mu.flex_attention_mask)
    mask = torch.tensor(rows_padded(300, (40, 300), (0, 200)))
    for mask_function, window in ((mu.causal_mask_function, None), (mu.sliding_window_causal_mask_function(128), 128)):
        block_mask = function(batch_size=2, q_length=300, kv_length=300, q_offset=0, kv_offset=0,
                              mask_function=mask_function, attention_mask=mask, local_size=window, device="cpu")
        assert int(block_mask.kv_num_blocks.sum()) > 0


@pytest.mark.slow
def test_both_layer_kinds_share_one_compiled_flex_attention_with_transformers_output(monkeypatch):
    """The block masks from bounds hold one mask function for full and sliding layers: torch.compile(flex_attention)
    (transformers' compiled flex attention) builds one graph for both kinds instead of one each, and gives the output
    of flex attention over transformers' own mask. Forward only: flex attention has no backward on the CPU."""
    import torch
    from torch.nn.attention.flex_attention import flex_attention

    torch._dynamo.reset()  # a compiled flex attention of this test's own
    try:
        compiled = torch.compile(flex_attention)
        g = torch.Generator().manual_seed(0)
        q, k, v = (torch.randn(2, 4, 300, 16, generator=g) for _ in range(3))
        mask = torch.tensor(rows_padded(300, (40, 300), (0, 200)))
        for sliding in (None, 128):
            ours = compiled(q, k, v, block_mask=flex_block_mask(monkeypatch, True, mask, sliding, 300, 0))
            theirs = flex_attention(q, k, v, block_mask=flex_block_mask(monkeypatch, False, mask, sliding, 300, 0))
            assert torch.allclose(ours, theirs, atol=1e-5, rtol=1e-5)
        assert len(torch._dynamo.eval_frame._debug_get_cache_entry_list(flex_attention.__code__)) == 1
    finally:
        torch._dynamo.reset()


def mask_functions():
    import transformers.masking_utils as mu

    return {
        "causal": mu.causal_mask_function,
        "sliding 128": mu.sliding_window_causal_mask_function(128),
        "sliding 64": mu.sliding_window_causal_mask_function(64),
        "overlay first, reversed": mu.and_masks(mu.causal_mask_function, mu.sliding_window_overlay(128)),
        "bidirectional": mu.bidirectional_mask_function,
        "causal and more": mu.and_masks(mu.causal_mask_function, mu.causal_mask_function),
    }


# (mask function, the local_size transformers passes along, what causal_window says: None causal, a window, or
# False for a mask worked out position by position)
CAUSAL_WINDOWS = [
    ("causal", None, None),  # create_causal_mask's function
    ("causal", 128, None),  # a window passed along does not make a causal mask sliding
    ("sliding 128", 128, 128),  # create_sliding_window_causal_mask's function, a fresh closure each call
    ("sliding 64", 128, False),  # a window other than the one passed along
    ("sliding 128", None, False),  # no window passed along
    ("sliding 128", True, False),  # not an int window
    ("overlay first, reversed", 128, False),  # the same mask composed otherwise: not recognised, still exact
    ("bidirectional", None, False),
    ("causal and more", None, False),
]


@pytest.mark.parametrize("name, local_size, expected", CAUSAL_WINDOWS)
def test_causal_window(name, local_size, expected):
    """Only transformers' own causal and sliding-window functions are recognised, each as what it is."""
    from tes_grpo.patches.transformers_patches import causal_window

    got = causal_window(mask_functions()[name], local_size)
    assert got is expected if expected in (None, False) else (type(got) is int and got == expected)


def test_flex_mask_wrapper_installs_once_and_passes_holes_through(monkeypatch):
    import torch
    import transformers.masking_utils as mu

    from tes_grpo.patches.transformers_patches import FlexMaskWithPaddingBounds, flex_masks_with_padding_bounds

    registry = mu.AttentionMaskInterface()  # a fresh instance: its local entries do not leak into other tests
    monkeypatch.setattr(mu, "ALL_MASK_ATTENTION_FUNCTIONS", registry)
    assert flex_masks_with_padding_bounds(say=pytest.fail)
    first = registry["flex_attention"]
    assert first.wraps_original is mu.flex_attention_mask
    assert flex_masks_with_padding_bounds(say=pytest.fail) and registry["flex_attention"] is first  # not twice
    calls = []
    wrapped = FlexMaskWithPaddingBounds(lambda **kwargs: calls.append(kwargs["attention_mask"]))
    wrapped(attention_mask=torch.tensor([[0, 1, 1], [1, 1, 1]]), mask_function=mu.causal_mask_function)
    wrapped(attention_mask=torch.tensor([[1, 0, 1], [1, 1, 1]]), mask_function=mu.causal_mask_function)
    wrapped(attention_mask=torch.ones(2, 3, dtype=torch.long), mask_function=mu.causal_mask_function)
    assert calls[0] is None  # bounds: transformers gets no per-position mask
    assert torch.equal(calls[1], torch.tensor([[1, 0, 1], [1, 1, 1]]))  # a hole: passed through
    assert torch.equal(calls[2], torch.ones(2, 3, dtype=torch.long))  # no padding: transformers skips it itself


@pytest.mark.parametrize("wait", [True, False])
def test_leave_process_group_destroys_the_group_once(wait):
    import torch.distributed as dist

    from tes_grpo.patches.torch_patches import leave_process_group

    assert not dist.is_initialized()
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    assert leave_process_group(wait) and not dist.is_initialized()
    assert not leave_process_group(wait)  # nothing left to leave


# ---------------------------------------------------------------------------------------------------------------
# The registry: every patch named with its versions, and the installed libraries held to the fingerprints
# ---------------------------------------------------------------------------------------------------------------

def installed(library: str) -> str:
    return importlib.metadata.version(library).split("+")[0]


def patched(entry):
    module, _, name = f"tes_grpo.{entry.patch}".rpartition(".")
    obj = None
    while module and obj is None:
        try:
            obj = importlib.import_module(module)
        except ModuleNotFoundError:
            module, _, parent = module.rpartition(".")
            name = f"{parent}.{name}"
    for part in name.split("."):
        obj = getattr(obj, part)
    return obj


def registry_entries():
    from tes_grpo.patches.registry import PATCHED

    return PATCHED


@pytest.mark.parametrize("entry", registry_entries(), ids=lambda e: e.patch)
def test_the_patched_function_has_a_fingerprint_it_was_checked_on(entry):
    from tes_grpo.patches.registry import fingerprint

    seen = fingerprint(entry.target)
    known = dict(entry.checked)
    assert seen in known.values(), (
        f"{entry.library} {installed(entry.library)} changed {entry.target} (fingerprint {seen}): re-check the patch "
        f"tes_grpo.{entry.patch} (checked on {entry.library} {', '.join(known)}), then add "
        f"({installed(entry.library)!r}, {seen!r}) to its entry in tes_grpo/patches/registry.py")


def served_versions(doc: str) -> list[tuple[tuple[int, int], tuple[int, int]]]:
    """The version ranges a docstring names: "5.17-5.24" and "1.16" (a range of one)."""
    ranges = []
    for low, high in re.findall(r"(\d+\.\d+)(?:-(\d+\.\d+))?", doc):
        parse = [tuple(int(n) for n in v.split(".")) for v in (low, high or low)]
        ranges.append((parse[0], parse[1]))
    return ranges


@pytest.mark.parametrize("entry", registry_entries(), ids=lambda e: e.patch)
def test_each_patch_exists_and_names_the_versions_it_serves(entry):
    doc = inspect.getdoc(patched(entry)) or ""
    assert entry.library.lower() in doc.lower(), f"tes_grpo.{entry.patch}'s docstring does not name {entry.library}"
    for version, _ in entry.checked:  # each version it was checked on, within what its docstring says it serves
        major_minor = tuple(int(n) for n in version.split(".")[:2])
        assert any(low <= major_minor <= high for low, high in served_versions(doc)), (
            f"tes_grpo.{entry.patch}: checked on {entry.library} {version}, which its docstring does not name")


# code whose docstring names a library version without being registered, each with why it needs no entry
UNREGISTERED_VERSIONED = {
    "experts.mxfp4._powers_of_two": "names the torch version a torch.ldexp difference was seen on; builds the powers "
                                    "from their bits, relying on no library code",
    "run.oom.use_expandable_segments": "sets torch's documented allocator variables, a public interface",
    "sampling.decode_math.attention_function": "names a torch limitation (inductor's CPU flex attention) it avoids by "
                                               "not compiling there; calls public API only",
}


@pytest.fixture(scope="module")
def package():
    from package_scan import package_modules

    return package_modules(Path(__file__).resolve().parents[1])


def registered_patches() -> set[str]:
    return {entry.patch for entry in registry_entries()}


def test_code_that_names_a_library_version_is_registered(package):
    """Every function, method or class of tes_grpo/ whose docstring names a library version has an entry (or is an
    UNREGISTERED_VERSIONED exception): code that follows a library version is held to that library's fingerprints."""
    from package_scan import versioned_definitions

    registered = registered_patches()
    versioned = [f for module in package for f in versioned_definitions(module)]
    found = [f for f in versioned if f.qualified not in registered and f.qualified not in UNREGISTERED_VERSIONED]
    assert not found, ("not in tes_grpo/patches/registry.py's PATCHED (register each with the library code it "
                       "follows, or add it to UNREGISTERED_VERSIONED with the reason):\n"
                       + "\n".join(map(str, found)))
    exceptions = set(UNREGISTERED_VERSIONED)
    stale = (exceptions & registered) | (exceptions - {f.qualified for f in versioned})
    assert not stale, f"UNREGISTERED_VERSIONED: registered, gone or naming no version now: {sorted(stale)}"


def test_only_registered_patches_assign_into_a_library(package):
    """An assignment into a library's module, class or registry is a patch: it is inside a registered one."""
    from package_scan import library_assignments

    registered = registered_patches()
    found = [f for module in package for f in library_assignments(module, registered)]
    assert not found, ("outside a patch registered in tes_grpo/patches/registry.py (move it into one, with its "
                       "versions and a fingerprint):\n" + "\n".join(map(str, found)))


def test_no_method_is_bound_on_an_instance(package):
    """Nothing in the product rebinds a method on an object (a subclass overrides it, or a registered patch wraps
    the class's own)."""
    from package_scan import instance_bindings, library_method_names

    names = library_method_names()
    found = [f for module in package for f in instance_bindings(module, names)]
    assert not found, "methods bound on objects:\n" + "\n".join(map(str, found))


def test_a_changed_function_fails_the_fingerprint():
    """The check itself: code that changes gets another fingerprint; docstrings, comments and layout do not count."""
    from tes_grpo.patches.registry import code_fingerprint

    before = 'def target(x):\n    """One docstring."""\n    return x + 1\n'
    reworded = ('    def target(x):\n        """Another docstring,\n        on two lines."""\n'
                '        # a comment\n        return  x + 1  # and another\n')
    changed = 'def target(x):\n    """One docstring."""\n    return x + 2\n'
    assert code_fingerprint(before) == code_fingerprint(reworded) != code_fingerprint(changed)


def test_a_version_not_installed_is_fingerprinted_from_its_files(tmp_path):
    """How the GPU machine's versions got their fingerprints here: from the files of an unpacked wheel, the same
    digits as from the installed module."""
    from tes_grpo.patches import registry

    package = tmp_path / "lib"
    package.mkdir()
    (package / "__init__.py").write_text("")
    (package / "mod.py").write_text("import os\n\n\nclass Thing:\n    @staticmethod\n    def method(x):\n"
                                    "        '''Doc.'''\n        return x\n")
    installed = registry.code_fingerprint("@staticmethod\ndef method(x):\n    '''Doc.'''\n    return x\n")
    assert registry.fingerprint_in_folder(tmp_path, "lib.mod:Thing.method") == installed
    assert registry.fingerprint_in_folder(tmp_path, "lib.mod:Thing.missing") is None


# (message, hidden?)
DEPRECATIONS = [
    ("`is_gradient_checkpointing` is deprecated and will be removed in v6.", True),  # TRL every generate, PEFT's wrap
    ("`gradient_checkpointing_disable` is deprecated and will be removed in v6.", True),  # TRL, around generate
    ("`gradient_checkpointing_enable` is deprecated and will be removed in v6.", True),
    ("`gradient_checkpointing_kwargs` is deprecated and will be removed in v6.", False),  # the project's to fix
]


@pytest.mark.parametrize("message, hidden", DEPRECATIONS)
def test_only_the_deprecations_trl_and_peft_trigger_are_hidden(message, hidden):
    import warnings

    from tes_grpo.patches.transformers_patches import quiet_gradient_checkpointing_deprecation

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        quiet_gradient_checkpointing_deprecation()
        warnings.warn(message, FutureWarning, stacklevel=1)
    assert (not caught) is hidden


# (a message of transformers' MXFP4 quantizer, still shown?)
MXFP4_WARNINGS = [
    ("MXFP4 inference on CPU requires use_kernels=True, but use_kernels is disabled. We will dequantize the model to "
     "bf16. To run MXFP4 natively on CPU, please set use_kernels=True.", False),  # even with dequantize=True asked
    ("MXFP4 quantization requires the `kernels` package: Please install a compatible version (0.18.2 <= version < "
     "0.19.0), e.g. `pip install kernels==0.18.2`We will default to dequantizing the model to bf16.", False),
    ("MXFP4 quantization requires Triton: CUDA requires Triton >= 3.4.0, XPU/CPU requires Triton >= 3.5.0. Please "
     "install triton: `pip install triton`. We will default to dequantizing the model to bf16.", False),
    ("Something else about MXFP4", True),  # its other warnings pass
]


@pytest.mark.parametrize("message, shown", MXFP4_WARNINGS)
def test_only_the_mxfp4_quantizers_dequantizing_warnings_are_dropped(message, shown):
    import logging

    from tes_grpo.patches.transformers_patches import MXFP4_LOGGER, quiet_mxfp4_fallback_warnings

    logger = logging.getLogger(MXFP4_LOGGER)
    record = logging.LogRecord(MXFP4_LOGGER, logging.WARNING, __file__, 1, message, None, None)
    quiet_mxfp4_fallback_warnings()
    quiet_mxfp4_fallback_warnings()  # once is enough: no second filter
    assert bool(logger.filter(record)) is shown
    assert len([f for f in logger.filters if type(f).__name__ == "Mxfp4FallbackFilter"]) == 1


def test_fingerprints_of_a_folder_that_is_not_there_are_an_error(tmp_path, capsys):
    from tes_grpo.patches import registry

    assert registry.main([str(tmp_path / "no-such-wheel")]) == 2
    assert "not a folder" in capsys.readouterr().err
