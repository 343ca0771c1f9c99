"""profile_decode.py's grouping of kernels (pure functions, made-up kernel names) and its whole flow at tiny shapes
on the CPU."""

import json
from types import SimpleNamespace

import pytest

from benchmarks import profile_decode as pd

TINY = {"num_hidden_layers": 2, "hidden_size": 64, "intermediate_size": 64, "num_attention_heads": 4,
        "num_key_value_heads": 2, "head_dim": 16, "num_local_experts": 4, "vocab_size": 512, "sliding_window": 8,
        "pad_token_id": 511, "eos_token_id": 510, "bos_token_id": 509}


@pytest.mark.parametrize("name, group", [
    ("experts_kernel", pd.MOE),  # mxfp4_kernels.experts_kernel
    ("_experts_kernel", pd.MOE),  # its name in older profiles
    ("triton_tem_fused_flex_decoding_0", pd.ATTENTION),
    ("triton_per_fused_2", pd.ELEMENTWISE),  # the compiled glue's norms; flex's own are claimed by its probe
    ("triton_poi_fused_add_cat_mul_0", pd.ELEMENTWISE),  # the compiled glue's rotary embedding
    ("void at::native::sbtopk::gatherTopK<c10::BFloat16, unsigned int, 2, false>(...)", pd.ROUTING),
    ("void at::native::bitonicSortKVInPlace<...>", pd.ROUTING),
    ("void at::native::index_copy_kernel_impl<...>", pd.KV_WRITES),
    ("void at::native::vectorized_elementwise_kernel<4, at::native::CUDAFunctor_add<c10::BFloat16>, ...>",
     pd.ELEMENTWISE),
    ("void at::native::reduce_kernel<512, 1, at::native::ReduceOp<float, at::native::MeanOps<...>>>", pd.ELEMENTWISE),
    ("Memcpy DtoD (Device -> Device)", pd.ELEMENTWISE),
    ("nvjet_tst_64x8_64x16_4x1_v_bz_TNT", None),  # a GEMM: only a probe can say whose
])
def test_rules_by_kernel_name(name, group):
    assert pd.rule_group(name) == group


def test_allocate_shares_each_kernel_among_its_call_sites():
    step = {"gemm_a": 100.0, "vectorized_elementwise_kernel<add>": 50.0, "nvjet_x": 10.0, "experts_kernel": 300.0,
            "gemm_b": 50.0}
    expected = {pd.PROJECTIONS: {"gemm_a": 60.0, "vectorized_elementwise_kernel<add>": 10.0, "gemm_b": 60.0},
                pd.HEAD: {"gemm_a": 20.0, "gemm_b": 40.0}}
    got = pd.allocate(step, expected)
    # more time than the probes expect, no rule: the rest follows the probes' proportions
    assert got["gemm_a"] == pytest.approx({pd.PROJECTIONS: 75.0, pd.HEAD: 25.0})
    # the LoRA add the projections' probe launched; the rest (residual adds) by the elementwise rule
    assert got["vectorized_elementwise_kernel<add>"] == pytest.approx({pd.PROJECTIONS: 10.0, pd.ELEMENTWISE: 40.0})
    assert got["nvjet_x"] == {None: 10.0}  # no probe launched it, no rule matches: ungrouped
    assert got["experts_kernel"] == {pd.MOE: 300.0}
    # less time than expected: scaled down in proportion
    assert got["gemm_b"] == pytest.approx({pd.PROJECTIONS: 30.0, pd.HEAD: 20.0})
    totals = pd.group_totals(got)
    assert sum(totals.values()) == pytest.approx(sum(step.values()))
    assert totals[None] == 10.0


def test_split_probe_separates_the_experts_kernel_from_the_routing():
    site = {"experts_kernel": 30.0, "gatherTopK": 2.0, "nvjet_router": 1.0}
    assert pd.split_probe(site) == {pd.MOE: {"experts_kernel": 30.0},
                                    pd.ROUTING: {"gatherTopK": 2.0, "nvjet_router": 1.0}}


def test_group_table_bytes_speed_and_gaps():
    from benchmarks import decode_limit as dl

    items = {dl.EXPERTS: 10e9, dl.ROUTER: 0.0, dl.KV_FULL: 2e9, dl.KV_SLIDING: 1e9, dl.PROJECTIONS: 1e9,
             dl.SMALL: 0.0, dl.LM_HEAD: 1e9, dl.KV_WRITES: 0.0}
    totals = {pd.MOE: 5000.0, pd.ATTENTION: 1500.0, pd.SAMPLING: 100.0, None: 7.0}
    rows = {r[0]: r for r in pd.group_table(totals, wall_us=10000.0, kernel_us=8000.0, items=items,
                                            logits_bytes=5e7, rate=3e12)}
    name, us, share, gb, speed, floor = rows[pd.MOE]
    assert (us, share, gb) == (5000.0, 0.5, 10.0) and speed == pytest.approx(2000.0)
    assert floor == pytest.approx(10e9 / 3e12 * 1e6)
    assert rows[pd.ATTENTION][3] == 3.0 and rows[pd.ATTENTION][4] == pytest.approx(2000.0)
    assert rows[pd.SAMPLING][3] == 0.05
    assert rows[pd.GAPS][1] == 2000.0
    assert rows["ungrouped kernels"][1] == 7.0
    assert rows["whole step (wall)"][3] == 15.0 and rows["whole step (wall)"][4] == pytest.approx(1500.0)


def test_ready_made_restores_and_says_when_generate_did_not_ask():
    module = SimpleNamespace(prefill="p", decode_weights="w", decode_steps="s")
    with pytest.raises(RuntimeError, match="decode_steps"):
        with pd.ready_made(module, "logits", "cache", "weights", "step"):
            assert module.prefill() == ("logits", "cache") and module.decode_weights() == "weights"
    assert (module.prefill, module.decode_weights, module.decode_steps) == ("p", "w", "s")
    with pd.ready_made(module, "logits", "cache", "weights", "step"):
        module.prefill(), module.decode_weights(), module.decode_steps()


@pytest.mark.slow
def test_the_whole_flow_on_cpu(tmp_path, capsys, monkeypatch):
    from tes_grpo.layers import decode_glue

    monkeypatch.setattr(decode_glue, "_DECIDED", {})  # said once a process: an earlier test may have decided it
    probes = []
    site_probes = pd.site_probes
    monkeypatch.setattr(pd, "site_probes", lambda *args: probes.append(site_probes(*args)) or probes[-1])
    out = tmp_path / "kernels.tsv"
    assert pd.main(["--DEVICE=cpu", "--ATTN=eager", "--EXPERTS=model", "--NUM_SEQS=4", "--PROMPT_LEN=40",
                    "--NEW_TOKENS=64", "--DECODE_AT=8", "--WALL_STEPS=4", "--PROFILE_STEPS=2", "--REPLAYS=2",
                    f"--OVERRIDES={json.dumps(TINY)}", f"--KERNELS_OUT={out}"]) == 0
    text = capsys.readouterr().out
    assert "measured from the router" in text and "kernels no probe launched and no rule matched (0;" in text
    assert "eager (DECODE_GLUE=compiled compiles only on CUDA; this is cpu)" in text  # the default glue, passed down
    glue_ops = probes[0][pd.ELEMENTWISE]  # the glue's own probe: the norm's rsqrt, the rotary embedding's halves
    assert glue_ops.get("aten::rsqrt", 0) > 0 and glue_ops.get("aten::cat", 0) > 0, glue_ops
    table = text[text.index("group "):].splitlines()
    assert [line[:32].strip() for line in table[1:]] == list(pd.GROUPS) + [pd.GAPS, "whole step (wall)"]
    lines = out.read_text().splitlines()
    assert lines[0].startswith("phase\tkernel")
    assert any(line.startswith("sampling\taten::multinomial") for line in lines)
    assert any(line.startswith("step\taten::") and pd.PROJECTIONS in line for line in lines)
