"""Patches of the libraries the project runs on, one module per library, kept apart from the product's code.

- torch_patches: private reads and process-group teardown (torch 2.8-2.13)
- transformers_patches: decode-time experts switch, TensorBoard folder and resume, flex attention's padded masks
- trl_patches: CPU scoring of completion positions, warnings a user cannot act on
- accelerate_patches: FSDP2 storage for trainable weights left on the meta device

The sampler's own wrappers around library calls (cross-process sync, vLLM's base-weight guard) live in sampler.py,
and sampling_fidelity.py's hooks of TRL's private GRPOTrainer methods there; both are listed in PATCHED below too.

`fixes.install(trainer)` is the one call that applies the corrections every run needs; the patches that only buy
speed are applied by fast_paths.py, which decides them. registry.PATCHED names, for every patch, the library function it
relies on, the versions it was checked on, and that function's fingerprint on each of them (`fingerprint`: a hash
of its code with docstrings and formatting left out, or of a builtin's signature). tests/test_patches.py fails when
the installed library's function has a fingerprint not listed, naming the patch to re-check: a version bump then
says what to look at instead of misbehaving silently. After re-checking a patch on a new version, add the new
fingerprint (`python -m tes_grpo.patches.registry` prints them all) and the version to its entry.
"""
