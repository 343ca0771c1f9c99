"""The decode step's newer Triton kernels compile for an H100 (sm_90) on the CPU, through Triton's own compiler and
ptxas, including where Triton turns an integer argument of 1 into a constant (a Python int inside the kernel, which
Triton's interpreter never does, so the interpreted tests cannot see it: a token count of 1 once failed to compile on
the GPU). Compiling is not running: tests/gpu_cuda_test.py runs them on CUDA."""

import pytest

triton = pytest.importorskip("triton", reason="requirements-test.txt installs triton")

ATTENTION = dict(Q="*bf16", K="*bf16", V="*bf16", Mask="*fp32", Seen="*i64", Out="*bf16", Lse="*fp32",
                 PartAcc="*fp32", PartMax="*fp32", PartSum="*fp32", length="i32", scale="fp32", per_split="i32",
                 sq_b="i32", sq_h="i32", sk_b="i32", sk_h="i32", sk_l="i32", sv_b="i32", sv_h="i32", sv_l="i32",
                 sm_b="i32")
ROUTE = dict(logits_ptr="*bf16", values_ptr="*bf16", indices_ptr="*i64", order_ptr="*i64", offsets_ptr="*i64",
             token_rows_ptr="*i64", tokens="i32", experts="i32", stride="i32")
COMBINE = dict(PartAcc="*fp32", PartMax="*fp32", PartSum="*fp32", Out="*bf16", Lse="*fp32", parts="i32")
LINEAR = dict(X="*bf16", W0="*bf16", W1="*bf16", W2="*bf16", A="*bf16", Out="*bf16", Bias="*bf16", B="*bf16",
              M="i32", K="i32", N="i32", N0="i32", N1="i32", N2="i32", tiles0="i32", tiles1="i32", scale="fp32",
              stride_x="i32")
QKV = dict(RANK=12, RANK_PAD=16, HAS_BIAS=True, HAS_LORA=True, HAS_SCALE=False, BLOCK_M=64, BLOCK_N=64, BLOCK_K=128,
           INTERPRETED=False)
GPT_OSS_ATTENTION = dict(KV_HEADS=8, GROUP=8, ROWS=16, DIM=64, DIM_PAD=64, BLOCK_N=64, INTERPRETED=False)

ATTN, LIN, ROUTING = "sampling.decode_attention", "sampling.decode_linear", "experts.moe_routing"

# (module, kernel, its arguments' types, constants: compile-time values and arguments Triton made constants of)
CASES = [
    (ATTN, "attention_kernel", ATTENTION, {**GPT_OSS_ATTENTION, "HAS_SEEN": True, "FINAL": True}),
    (ATTN, "attention_kernel", ATTENTION, {**GPT_OSS_ATTENTION, "HAS_SEEN": False, "FINAL": False}),
    (ATTN, "attention_kernel", ATTENTION,  # one slot, one part's worth: counts of 1 made constants
     {**GPT_OSS_ATTENTION, "HAS_SEEN": False, "FINAL": True, "length": 1, "per_split": 1}),
    (ATTN, "combine_kernel", COMBINE, {"DIM": 64, "DIM_PAD": 64}),
    (LIN, "linear_kernel", LINEAR, QKV),  # gpt-oss's q, k, v with LoRA, its scaling folded
    (LIN, "linear_kernel", LINEAR, {**QKV, "RANK": 4, "HAS_SCALE": True, "BLOCK_N": 32}),  # o_proj
    (LIN, "linear_kernel", LINEAR,  # one row, one tile, no adapter: counts of 1 made constants
     {**QKV, "HAS_LORA": False, "RANK": 0, "BLOCK_M": 16, "M": 1, "tiles0": 1}),
    (ROUTING, "_top_k_route_kernel", ROUTE,  # gpt-oss-20b's decode step: 64 tokens, top-4 of 32
     {"TOKENS": 64, "EXPERTS_BLOCK": 32, "TOP_K": 4, "K_BLOCK": 4}),
    (ROUTING, "_top_k_route_kernel", ROUTE,  # gpt-oss-120b's 128 experts
     {"TOKENS": 64, "EXPERTS_BLOCK": 128, "TOP_K": 4, "K_BLOCK": 4}),
    (ROUTING, "_top_k_route_kernel", ROUTE,  # one token: the count made a constant
     {"TOKENS": 16, "EXPERTS_BLOCK": 32, "TOP_K": 4, "K_BLOCK": 4, "tokens": 1}),
]


@pytest.mark.parametrize("module, kernel, arguments, constants", CASES)
def test_the_kernel_compiles_for_sm90(module, kernel, arguments, constants):
    import importlib

    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    fn = getattr(importlib.import_module(f"tes_grpo.{module}"), kernel)
    if type(fn).__name__ == "InterpretedFunction":
        pytest.skip("TRITON_INTERPRET=1 for this module: nothing to compile")
    types = {**arguments, **{name: "constexpr" for name in constants}}
    names = list(fn.arg_names)  # the kernel's order, whatever order the case lists them in
    signature = {name: types[name] for name in names}
    source = ASTSource(fn=fn, signature=signature, constexprs={(names.index(n),): v for n, v in constants.items()})
    compiled = triton.compile(source, target=GPUTarget("cuda", 90, 64), options={"num_warps": 4})
    assert compiled.asm["cubin"]
