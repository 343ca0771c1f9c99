"""Patches of the libraries the project runs on, one module per library, kept apart from the product's code.

- torch_patches: private reads and process-group teardown (torch 2.8-2.13)
- transformers_patches: decode-time experts switch, TensorBoard folder and resume, flex attention's padded masks
- trl_patches: CPU scoring of completion positions, warnings a user cannot act on
- accelerate_patches: FSDP2 storage for trainable weights left on the meta device
- fixes: the corrections every run needs, applied by `quiet_library_warnings()` (before the trainer is built) and
  `install(trainer, ...)`; the patches that only buy speed are applied by fast_paths.py, which decides them
- registry: every patch, and the code below, with the library code it relies on, the versions it was checked on,
  and that code's fingerprint on each of them

Code elsewhere in the package that mirrors, overrides or relies on a library's internals is registered here too:
the trainer's overrides of TRL's private GRPOTrainer methods, the LM head's readings of TRL's fused head; the decode
step's copy of gpt-oss's forward, its KV cache read from transformers' DynamicCache, generate()'s warpers and sampling
loop; the decode and training glue's copies of transformers' and PEFT's forwards; the fused and MXFP4 experts' copies of
transformers' experts and its MXFP4 dequantization. registry.PATCHED names each with the library code it follows.
tests/test_patches.py scans the whole package (tests/package_scan.py, syntax only) and fails on a function, method
or class whose docstring names a library version without being registered (a short table in the test lists the few
exceptions, each with its reason), on an assignment into a library's module, class or registry outside a registered
patch, and on any method bound on an object (a subclass overrides instead).

A fingerprint is a hash of a function's code with docstrings, comments and whitespace left out (or of a builtin's
signature). tests/test_patches.py fails when an installed library's function has a fingerprint not listed, naming
the patch to re-check: a version bump then says what to look at instead of misbehaving silently. After re-checking
a patch on a new version, add its fingerprint and the version to the entry: `python -m tes_grpo.patches.registry`
prints them for the installed libraries, `python -m tes_grpo.patches.registry FOLDER` for an unpacked wheel.
"""
