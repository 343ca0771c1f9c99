"""Patches of the libraries the project runs on, one module per library, kept apart from the product's code.

- torch_patches: private reads and process-group teardown (torch 2.8-2.13)
- transformers_patches: decode-time experts switch, TensorBoard folder and resume, flex attention's padded masks
- trl_patches: CPU scoring of completion positions, warnings a user cannot act on
- accelerate_patches: FSDP2 storage for trainable weights left on the meta device
- fixes: the corrections every run needs, applied by `quiet_library_warnings()` (before the trainer is built) and
  `install(trainer, ...)`; the patches that only buy speed are applied by fast_paths.py, which decides them
- registry: every patch with the library function it relies on, the versions it was checked on, and that
  function's fingerprint on each of them

Code elsewhere in the package that mirrors or overrides a library's internals (the trainer's overrides of TRL's private
GRPOTrainer methods, the decode step's copy of gpt-oss's forward, the sampler's reading of generate()'s options, the
training glue's copies of PEFT's and transformers' forwards) is registered here too: registry.PATCHED names each with
the library function it mirrors, and tests/test_patches.py scans the whole package for code that names a library
version in its docstring or assigns into a library's module or class, and fails on any that is not registered.

A fingerprint is a hash of a function's code with docstrings, comments and whitespace left out (or of a builtin's
signature). tests/test_patches.py fails when an installed library's function has a fingerprint not listed, naming
the patch to re-check: a version bump then says what to look at instead of misbehaving silently. After re-checking
a patch on a new version, add its fingerprint and the version to the entry: `python -m tes_grpo.patches.registry`
prints them for the installed libraries, `python -m tes_grpo.patches.registry FOLDER` for an unpacked wheel.
"""
