"""tests/package_scan.py, the reading of tes_grpo/ that tests/test_patches.py holds to the patch registry: each rule
finds what it names in planted code, with its line and qualified name, and leaves alone what it does not name."""

from __future__ import annotations

import textwrap

from package_scan import (
    instance_bindings,
    library_assignments,
    library_method_names,
    parse,
    versioned_definitions,
)


def planted(source: str):
    return parse(textwrap.dedent(source), "tes_grpo/layers/planted.py", "layers.planted")


def found(findings) -> list[tuple[int, str]]:
    return sorted((f.line, f.qualified) for f in findings)


VERSIONED = planted('''
    def follows():
        """As TRL 1.16's fused head computes it."""

    class Mirror:
        """Steps of transformers 5.17-5.24's decoder layer."""

        def forward(self):
            """PEFT 0.21's lora.Linear.forward, rounding for rounding."""

            def inner():
                """needs torch >= 2.11"""

    def compiled():
        """A kernel that needs Triton 3.6, compiled for transformers' shapes."""

    def plain():
        """No library version here: 5.17 alone, or torch's defaults."""
''')


def test_docstrings_that_name_a_library_version_are_found():
    assert found(versioned_definitions(VERSIONED)) == [
        (2, "layers.planted.follows"), (5, "layers.planted.Mirror"), (8, "layers.planted.Mirror.forward"),
        (11, "layers.planted.Mirror.forward.inner")]


ASSIGNMENTS = planted('''
    import torch
    import trl.trainer.utils as trl_utils
    import transformers.masking_utils as mu
    from transformers.generation.utils import GenerationMixin
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

    def unregistered(fn):
        trl_utils._use_triton = fn
        GenerationMixin._optimize_model_for_decode = fn
        ALL_ATTENTION_FUNCTIONS["flex_attention"] = fn
        registry = mu.ALL_MASK_ATTENTION_FUNCTIONS
        registry["flex_attention"] = fn
        setattr(GenerationMixin, "generate", fn)
        del vars(GenerationMixin)["generate"]
        torch.backends.cuda.matmul.allow_tf32 = True
        found = getattr(mu, "ALL_MASK_ATTENTION_FUNCTIONS")
        found.update(sdpa=fn)

        def inner():
            from transformers.models.gpt_oss import modeling_gpt_oss
            modeling_gpt_oss.apply_rotary_pos_emb = fn

    def registered(fn):
        trl_utils._use_triton = fn

        def inner():
            ALL_ATTENTION_FUNCTIONS["sdpa"] = fn

    def reads_only(model):
        model.config.use_cache = True
        current = trl_utils._use_triton
        zeros = torch.zeros(2)
        zeros[0] = 1
        entry = ALL_ATTENTION_FUNCTIONS.get("sdpa")
        entry.name = "mine"
''')


def test_assignments_into_a_library_outside_a_registered_patch_are_found():
    assert found(library_assignments(ASSIGNMENTS, {"layers.planted.registered"})) == [
        (9, "layers.planted.unregistered"), (10, "layers.planted.unregistered"), (11, "layers.planted.unregistered"),
        (13, "layers.planted.unregistered"), (14, "layers.planted.unregistered"),
        (15, "layers.planted.unregistered"), (16, "layers.planted.unregistered"),
        (18, "layers.planted.unregistered"), (22, "layers.planted.unregistered.inner")]


def test_a_registered_patch_may_assign_into_a_library():
    registered = {"layers.planted.registered", "layers.planted.unregistered"}
    assert found(library_assignments(ASSIGNMENTS, registered)) == []


BINDINGS = planted('''
    import functools
    import types
    from trl import GRPOTrainer

    def rebinds(model, trainer, layer, fn, vllm_generation):
        layer.forward = types.MethodType(fn, layer)
        model.generate = fn
        trainer._compute_loss = fn
        setattr(model, "forward", functools.partial(fn, model))
        vllm_generation.__dict__["sync_weights"] = fn
        model.hook = lambda x: x
        model.callback = wrapped
        model.wrapped = functools.wraps(fn)(wrapped)

        def wrapped(*args):
            return fn(*args)

    def leaves_alone(model, module, variant, fn):
        module.__class__ = variant
        model.config.use_cache = True
        model.generation_config = fn()
        rebinds.calls = 1

    class Own:
        def __init__(self, fn):
            self.generate = fn

    class Trainer(GRPOTrainer):
        def __init__(self, fn):
            self._compute_loss = fn
            self.say = fn
''')
METHODS = {"forward", "generate", "_compute_loss", "sync_weights"}


def test_methods_bound_on_objects_are_found():
    assert found(instance_bindings(BINDINGS, METHODS)) == [
        (7, "layers.planted.rebinds"), (8, "layers.planted.rebinds"), (9, "layers.planted.rebinds"),
        (10, "layers.planted.rebinds"), (11, "layers.planted.rebinds"), (12, "layers.planted.rebinds"),
        (13, "layers.planted.rebinds"), (14, "layers.planted.rebinds"),
        (31, "layers.planted.Trainer.__init__")]


def test_a_finding_names_file_line_and_code():
    first = next(iter(instance_bindings(BINDINGS, METHODS)))
    assert str(first).startswith("tes_grpo/layers/planted.py:7 layers.planted.rebinds: binds a method on an object: "
                                 "layer.forward = types.MethodType(fn, layer)")


def test_the_library_methods_include_those_of_models_trainers_and_vllm_sync():
    names = library_method_names()
    assert {"forward", "generate", "_compute_loss", "_generate_single_turn", "sync_weights", "merge_adapter",
            "_get_per_token_logps_and_entropies"} <= names
    assert "gradient_checkpointing" not in names and "__class__" not in names  # attributes, not methods
