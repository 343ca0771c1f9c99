"""benchmarks/mfu.py: bench_grpo's train MFU against the GPU's spec dense bf16 peak, the measured-rate share beside it,
and the spec table by device name. Table-driven, CPU, no model."""

import pytest

from benchmarks import mfu

# (torch.cuda.get_device_name(), --SPEC_TFLOPS, expected TFLOP/s or None, words in the source)
PEAKS = [
    ("NVIDIA H100 80GB HBM3", 0.0, 989.0, "NVIDIA H100 80GB HBM3's spec dense bf16 peak (mfu.SPEC_BF16_TFLOPS)"),
    ("NVIDIA H200", 0.0, 989.0, "NVIDIA H200's spec dense bf16 peak"),
    ("NVIDIA H100 PCIe", 0.0, 756.0, "spec dense bf16 peak"),
    ("NVIDIA H200 NVL", 0.0, None, "no spec peak for 'NVIDIA H200 NVL'"),  # another card than the H200 SXM
    ("NVIDIA H200 NVL", 835.0, 835.0, "as given (SPEC_TFLOPS)"),
    ("NVIDIA H200", 900.0, 900.0, "as given (SPEC_TFLOPS)"),  # the setting wins over the table
    ("Some GPU", 0.0, None, "give --SPEC_TFLOPS="),
]


@pytest.mark.parametrize("name, given, tflops, words", PEAKS)
def test_spec_peak_by_exact_device_name_or_as_given(name, given, tflops, words):
    got, source = mfu.spec_peak(name, given)
    assert got == tflops and words in source, source


@pytest.mark.parametrize("given", [-1.0, float("inf")])
def test_a_bad_spec_peak_is_refused(given):
    with pytest.raises(ValueError, match="SPEC_TFLOPS="):
        mfu.spec_peak("NVIDIA H200", given)


# (train GFLOP, attention GFLOP, training s, spec, measured; expected train_mfu, +attn, of measured, +attn)
STEPS = [
    # BENCHMARKS.md's H100 figures as the measured-rate shares they were: 42.8 % and 46.7 % of 800 TFLOP/s are
    # 34.6 % and 37.8 % of the spec 989
    (800 * 0.428 * 10e3, 800 * (0.467 - 0.428) * 10e3, 10.0, 989.0, 800.0, 0.346, 0.378, 0.428, 0.467),
    (989e3, 0.0, 1.0, 989.0, 800.0, 1.0, 1.0, 989 / 800, 989 / 800),  # the spec peak reached: 100 %
    (500e3, 100e3, 2.0, None, 800.0, None, None, 500 / 1600, 600 / 1600),  # unknown GPU: no MFU, the share stays
]


@pytest.mark.parametrize("train, attention, seconds, spec, measured, mfu_, mfu_attn, share, share_attn", STEPS)
def test_mfu_fields_divide_by_the_spec_peak_and_the_measured_rate(train, attention, seconds, spec, measured, mfu_,
                                                                  mfu_attn, share, share_attn):
    row = mfu.mfu_fields(train, attention, seconds, spec, measured)
    for key, expected in [("train_mfu", mfu_), ("train_mfu_with_attention", mfu_attn), ("train_of_measured", share),
                          ("train_of_measured_with_attention", share_attn)]:
        if expected is None:
            assert row[key] is None, key
        else:
            assert row[key] == pytest.approx(expected, abs=5e-4), key
    assert (row["spec_tflops"], row["measured_tflops"]) == (spec, measured)


def test_the_table_cells_line_up_under_the_columns_and_say_n_a_without_a_peak():
    known = mfu.cells(mfu.mfu_fields(989e3 * 0.346, 989e3 * 0.032, 1.0, 989.0, 800.0))
    unknown = mfu.cells(mfu.mfu_fields(1.0, 0.0, 1.0, None, 800.0))
    assert len(known) == len(unknown) == len(mfu.COLUMNS)
    assert known.split() == ["34.6%", "37.8%", "42.8%", "46.7%"]
    assert unknown.split()[:2] == ["n/a", "n/a"]


def test_the_explanation_names_the_gpu_its_peak_and_the_measured_rate():
    line = mfu.explanation(*mfu.spec_peak("NVIDIA H200"), 22.0, 800.0)
    assert "NVIDIA H200's spec dense bf16 peak (mfu.SPEC_BF16_TFLOPS), 989 TFLOP/s" in line
    assert "22 GFLOP a trained token" in line and "BF16_TFLOPS, 800 TFLOP/s" in line
    assert "MFU not computed" in mfu.explanation(*mfu.spec_peak("Some GPU"), 22.0, 800.0)
