"""Train MFU for benchmarks/bench_grpo.py: the training FLOP a step counts, over its training seconds, against the
GPU's spec dense bf16 peak; and, as a second, named column, the same against a measured bf16 matrix rate.

MFU as the term is used (PaLM's, nanoGPT's) divides by the hardware's peak, so the spec figure is the denominator:
989 TFLOP/s for the H100 SXM and the H200 (NVIDIA's data sheets give 1,979 "with sparsity"; dense is half). The
measured rate (bench_grpo's BF16_TFLOPS, 800 TFLOP/s from large bf16 matmuls on an H100) says how close training
comes to what a matmul reaches there, which the spec figure does not. A GPU missing from SPEC_BF16_TFLOPS gets no
MFU unless its peak is given (bench_grpo's --SPEC_TFLOPS=).
"""

from __future__ import annotations

import math

# torch.cuda.get_device_name() -> dense (no sparsity) bf16 tensor-core peak, TFLOP/s, from NVIDIA's data sheets.
# Exact names only: "NVIDIA H200 NVL" and "NVIDIA H100 NVL" are other cards with lower clocks and peaks.
SPEC_BF16_TFLOPS = {
    "NVIDIA H100 80GB HBM3": 989.0,  # H100 SXM5
    "NVIDIA H200": 989.0,  # H200 SXM, 141 GB
    "NVIDIA H100 PCIe": 756.0,
    "NVIDIA A100-SXM4-80GB": 312.0,
    "NVIDIA A100-SXM4-40GB": 312.0,
    "NVIDIA A100 80GB PCIe": 312.0,
    "NVIDIA A100-PCIE-40GB": 312.0,
}

# bench_grpo's table: MFU and +attn against the spec peak, then the same against the measured rate
COLUMNS = f"{'MFU':>7}{'+attn':>7}{'of meas':>9}{'+attn':>7}"


def spec_peak(device_name: str, given: float = 0.0) -> tuple[float | None, str]:
    """(spec dense bf16 TFLOP/s or None, where it came from): `given` (> 0: --SPEC_TFLOPS) wins, else the table by
    the exact device name, else None with the reason."""
    if given < 0 or not math.isfinite(given):
        raise ValueError(f"SPEC_TFLOPS={given}: a GPU's dense bf16 peak in TFLOP/s, or 0 to look it up by name")
    if given:
        return given, f"{device_name}'s spec dense bf16 peak as given (SPEC_TFLOPS)"
    if device_name in SPEC_BF16_TFLOPS:
        return SPEC_BF16_TFLOPS[device_name], f"{device_name}'s spec dense bf16 peak (mfu.SPEC_BF16_TFLOPS)"
    return None, (f"no spec peak for {device_name!r} in mfu.SPEC_BF16_TFLOPS: MFU not computed; give "
                  "--SPEC_TFLOPS=<its dense bf16 TFLOP/s>")


def mfu_fields(train_gflop: float, attention_gflop: float, seconds: float, spec_tflops: float | None,
               measured_tflops: float) -> dict:
    """A step's MFU fields: train_mfu (the parameters' FLOP) and train_mfu_with_attention (attention's matmuls too)
    against the spec peak (None without one), the same two against the measured rate, and both rates."""
    seconds = max(seconds, 1e-9)

    def share(gflop: float, tflops: float | None) -> float | None:
        return gflop * 1e9 / (tflops * 1e12 * seconds) if tflops else None

    return dict(train_mfu=share(train_gflop, spec_tflops),
                train_mfu_with_attention=share(train_gflop + attention_gflop, spec_tflops),
                train_of_measured=share(train_gflop, measured_tflops),
                train_of_measured_with_attention=share(train_gflop + attention_gflop, measured_tflops),
                spec_tflops=spec_tflops, measured_tflops=measured_tflops)


def cells(row: dict) -> str:
    """A step row's four MFU cells under COLUMNS, "n/a" where there is no spec peak (rows of mfu_fields)."""
    def cell(value: float | None, width: int) -> str:
        return f"{'n/a':>{width}}" if value is None else f"{100 * value:>{width - 1}.1f}%"

    return (cell(row["train_mfu"], 7) + cell(row["train_mfu_with_attention"], 7)
            + cell(row["train_of_measured"], 9) + cell(row["train_of_measured_with_attention"], 7))


def explanation(spec_tflops: float | None, source: str, gflop_per_token: float, measured_tflops: float) -> str:
    """The line above bench_grpo's table that says what the MFU columns divide by."""
    against = f"{source}, {spec_tflops:g} TFLOP/s" if spec_tflops else source
    return (f"train MFU: {gflop_per_token:g} GFLOP a trained token ('+attn': attention's matmuls too) a training "
            f"second, against {against}; 'of meas': the same against BF16_TFLOPS, {measured_tflops:g} TFLOP/s, a "
            "measured bf16 matrix rate (the default 800: large matmuls on an H100)")
