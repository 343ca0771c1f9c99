"""benchmarks/bench_mxfp4_load.py on the CPU at toy shapes: it writes the random checkpoint, loads it both ways in
child processes, dequantizes, runs the one-layer pass both ways and prints its table (what the GPU run relies on)."""

import json

import pytest

pytestmark = pytest.mark.usefixtures("one_torch_thread")

TOY = {"num_hidden_layers": 2, "hidden_size": 64, "intermediate_size": 64, "num_local_experts": 8,
       "vocab_size": 512, "pad_token_id": 5, "eos_token_id": 3, "bos_token_id": 1}


@pytest.mark.slow
def test_bench_runs_on_toy_shapes(tmp_path, capsys):
    import benchmarks.bench_mxfp4_load as bench

    argv = [f"--OVERRIDES={json.dumps(TOY)}", "--TOKENS=48", "--REPS=1", f"--CHECKPOINT_DIR={tmp_path / 'ckpt'}",
            f"--RESULTS={tmp_path / 'results.jsonl'}"]
    assert bench.main(argv) == 0
    out = capsys.readouterr().out
    table = out[out.index("load (fresh process)"):].splitlines()
    assert table[1].startswith("resident MXFP4 experts") and table[1].split()[-1] == "2"  # both layers resident
    assert table[2].startswith("dequantized (Mxfp4Config)") and table[2].split()[-1] == "0"
    assert "torch codec (mxfp4_experts, per expert)" in out and "True / True" in out  # equal to transformers
    row = json.loads((tmp_path / "results.jsonl").read_text())
    assert [r["experts"] for r in row["layer"]] == ["bf16", "mxfp4", "bf16", "mxfp4"]
    assert all(r["equal_to_bf16"] for r in row["layer"] if r["experts"] == "mxfp4")
    assert (tmp_path / "ckpt" / "gpt-oss-20b-random" / "model.safetensors").is_file()
