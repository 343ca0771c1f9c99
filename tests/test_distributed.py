"""train_grpo.py on two processes (accelerate launch with the shipped DDP config; gloo on this CPU machine).

One module fixture (~2 min on 2 cores) launches the tiny gpt-oss for 2 optimizer steps on 2 processes, saving a
checkpoint at step 2, then resumes it to step 3 with 2 processes again. The tests read what the run left behind
and check the rank-aware behaviour: the stream's prompts split between the ranks in whole groups, every rank's
completions logged once with their own prompt's rewards, metrics written once, checkpoints with both ranks' state,
resume on the right step and prompts, one adapter that loads on one process.
"""

from __future__ import annotations

import itertools
import json
import os
import socket
import subprocess
import sys
from pathlib import Path

import pandas as pd
import pytest
from grpo_fixtures import rewards_by_prompt, write_fixture_data

import train_grpo
from tes_grpo.model_loading import (
    check_visible_gpus,
    empty_policy_model,
    load_training_model,
    loads_weights_here,
    model_device_map,
    resolve_model_path,
)
from tes_grpo.patches.accelerate_patches import give_trainable_weights_storage
from tes_grpo.run_folder import check_resume_processes

REPO = Path(__file__).resolve().parents[1]
PROCESSES, GENERATIONS, ACCUMULATION, SAVE_AT, RESUMED_TO = 2, 4, 2, 2, 3
ROWS_PER_STEP = PROCESSES * ACCUMULATION * GENERATIONS  # 1 prompt per micro-step


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


# The shipped config the launches use: ddp.yaml (gloo on CPU); on a machine with 2 GPUs, fsdp2.yaml checks the same
# behaviour with sharded weights (GRPO_TEST_ACCELERATE_CONFIG=fsdp2.yaml; BENCHMARKS.md says when it was run).
CONFIG = REPO / "configs" / "accelerate" / os.environ.get("GRPO_TEST_ACCELERATE_CONFIG", "ddp.yaml")


def launch(args: list[str], log: Path) -> None:
    """accelerate launch with CONFIG on PROCESSES processes; fails with the log's tail."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(("GRPO_", "ACCELERATE_"))}
    env.update(OMP_NUM_THREADS="1", TOKENIZERS_PARALLELISM="false", NCCL_NVLS_ENABLE="0")
    command = [sys.executable, "-m", "accelerate.commands.launch", "--config_file", str(CONFIG),
               "--num_processes", str(PROCESSES),
               "--mixed_precision", "no", "--main_process_port", str(free_port()), str(REPO / "train_grpo.py"), *args]
    with open(log, "w") as handle:
        done = subprocess.run(command, cwd=REPO, env=env, stdout=handle, stderr=subprocess.STDOUT, timeout=900)
    if done.returncode != 0:
        pytest.fail(f"accelerate launch exited {done.returncode}:\n" + log.read_text()[-4000:])


@pytest.fixture(scope="module")
def run(tmp_path_factory, tokenizer):
    root = tmp_path_factory.mktemp("ddp")
    data = write_fixture_data(root, tokenizer)
    out = root / "run"
    args = ["--MODEL_ID=tiny", f"--DATA_DIR={data}", f"--EVAL_DIR={data / 'eval'}", f"--OUT_DIR={out}",
            f"--NUM_GENERATIONS={GENERATIONS}", f"--GRADIENT_ACCUMULATION_STEPS={ACCUMULATION}",
            "--MAX_COMPLETION_LEN=40", f"--SAVE_STEPS={SAVE_AT}"]
    resolve_model_path("tiny")  # build the tiny checkpoint here, outside the timed launches
    launch(args + [f"--TOTAL_STEPS={SAVE_AT}"], root / "first.log")
    first = {"log": pd.read_csv(out / "completions.csv", keep_default_na=False),
             "console": (root / "first.log").read_text(),
             "checkpoint": sorted(p.name for p in (out / f"checkpoint-{SAVE_AT:06d}").iterdir())}
    launch(args + [f"--TOTAL_STEPS={RESUMED_TO}", "--RESUME=1"], root / "resumed.log")
    settings = train_grpo.default_settings(
        DATA_DIR=str(data), EVAL_DIR=str(data / "eval"), NUM_GENERATIONS=GENERATIONS,
        GRADIENT_ACCUMULATION_STEPS=ACCUMULATION)
    frame = train_grpo.load_training_data(settings, tokenizer)
    stream = train_grpo.build_stream(frame, settings, processes=PROCESSES)
    groups = itertools.islice(stream.micro_steps(), RESUMED_TO * PROCESSES * ACCUMULATION)
    micro_steps = [group[0]["prompt"] for group in groups]
    return {"out": out, "first": first, "micro_steps": micro_steps,
            "resumed_console": (root / "resumed.log").read_text(), "rewards": rewards_by_prompt(tokenizer, "medium")}


@pytest.mark.slow
def test_each_rank_trains_its_own_slice_of_the_stream_in_whole_groups(run):
    log = pd.read_csv(run["out"] / "completions.csv", keep_default_na=False)
    assert sorted(set(log["rank"])) == list(range(PROCESSES))
    for step in range(1, RESUMED_TO + 1):
        rows = log[log["step"] == step]
        assert len(rows) == ROWS_PER_STEP
        by_rank = {}
        for rank in range(PROCESSES):
            mine = rows[rows["rank"] == rank]
            assert len(mine) == ACCUMULATION * GENERATIONS
            for micro in range(ACCUMULATION):
                group = mine[mine["micro_step"] == micro]
                # a whole group of one prompt, the one the stream put in this rank's slot of this optimizer step
                expected = run["micro_steps"][(step - 1) * PROCESSES * ACCUMULATION + rank * ACCUMULATION + micro]
                assert group["prompt"].tolist() == [expected] * GENERATIONS
            by_rank[rank] = set(mine["prompt"])
        assert not by_rank[0] & by_rank[1]  # the ranks train different prompts


@pytest.mark.slow
def test_every_rank_is_logged_once_with_its_own_prompts_rewards(run):
    log = pd.read_csv(run["out"] / "completions.csv", keep_default_na=False)
    assert len(log) == ROWS_PER_STEP * RESUMED_TO  # no rank's rows missing or written twice
    assert (run["out"] / "completions.csv").read_text().count('"step","micro_step",') == 1  # one header (fields quoted)
    for _, row in log.iterrows():
        rewards, optimal = run["rewards"][row["prompt"]]
        assert int(row["target_action"]) == optimal
        if row["action"] != "":
            assert float(row["reward"]) == pytest.approx(rewards[int(row["action"])], abs=1e-12)


@pytest.mark.slow
def test_metrics_and_progress_written_once(run):
    metrics = [json.loads(line) for line in (run["out"] / "metrics.jsonl").read_text().splitlines()]
    assert [m["step"] for m in metrics if "reward" in m] == [1, 2, 3]
    assert run["first"]["console"].count(f"step 1/{SAVE_AT}") == 1
    assert run["first"]["console"].count("batch: ") == 1
    assert f"{PROCESSES} processes train {ROWS_PER_STEP} completions" in run["first"]["console"]
    config = json.loads((run["out"] / "train_config.json").read_text())
    assert config["derived"]["processes"] == PROCESSES


@pytest.mark.slow
def test_the_processes_train_with_the_experts_resident(run):
    """EXPERTS=auto keeps the tiny checkpoint's experts resident as MXFP4 under DDP too (one copy per process)."""
    assert "with its experts resident as MXFP4" in run["first"]["console"]


@pytest.mark.slow
def test_checkpoint_holds_every_rank_and_resume_continues(run):
    out = run["out"]
    assert sorted(p.name for p in out.glob("checkpoint-*")) == ["checkpoint-000002", "checkpoint-000003"]
    assert {f"rng_state_{rank}.pth" for rank in range(PROCESSES)} <= set(run["first"]["checkpoint"])
    assert "resuming from" in run["resumed_console"] and run["resumed_console"].count("resuming from") == 1
    assert json.loads((out / "trainer_state.json").read_text())["global_step"] == RESUMED_TO
    log = pd.read_csv(out / "completions.csv", keep_default_na=False)
    kept = log[log["step"] <= SAVE_AT].reset_index(drop=True)
    assert kept.equals(run["first"]["log"])  # steps before the checkpoint untouched, nothing duplicated


@pytest.mark.slow
def test_adapter_saved_once_loads_on_one_process(run):
    from peft import PeftModel
    from safetensors.torch import load_file

    model = PeftModel.from_pretrained(load_training_model(resolve_model_path("tiny")), str(run["out"]))
    saved = load_file(run["out"] / "adapter_model.safetensors")
    loaded = {n.replace(".default", ""): p for n, p in model.named_parameters() if "lora_" in n}
    assert saved and set(saved) == set(loaded)
    assert any(float(t.abs().max()) > 0 for n, t in saved.items() if "lora_B" in n)  # trained, not the zero init
    for name, tensor in saved.items():
        assert tensor.equal(loaded[name].detach().cpu())


# ---------------------------------------------------------------------------------------------------------------
# The helpers on one process (no launcher): what a single `python train_grpo.py` relies on
# ---------------------------------------------------------------------------------------------------------------

def test_one_process_helpers_act_like_plain_code(capsys, monkeypatch):
    from tes_grpo import processes
    for name in ("WORLD_SIZE", "RANK", "LOCAL_RANK", "ACCELERATE_USE_FSDP"):
        monkeypatch.delenv(name, raising=False)
    assert (processes.process_count(), processes.process_rank(), processes.is_main_process()) == (1, 0, True)
    assert processes.gather_on_main([1, 2]) == [1, 2]
    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.setenv("RANK", "1")
    assert processes.gather_on_main([1, 2]) is None  # ranks without a process group: only rank 0 keeps its rows
    monkeypatch.delenv("WORLD_SIZE")
    monkeypatch.delenv("RANK")
    processes.wait_for_everyone()  # no process group: nothing to wait for
    processes.say("hello")
    assert capsys.readouterr().out == "hello\n"
    monkeypatch.setenv("RANK", "1")
    processes.say("hidden")
    assert capsys.readouterr().out == ""


# (cuda, FSDP, processes, local rank, expected device_map)
DEVICE_MAPS = [
    (True, False, 1, 0, "cuda"),  # one GPU
    (True, False, 2, 1, {"": 1}),  # DDP: each process its own GPU
    (True, True, 2, 1, None),  # FSDP: CPU, then sharded
    (False, False, 2, 1, None),  # no GPU
]


@pytest.mark.parametrize("cuda, fsdp, processes, rank, expected", DEVICE_MAPS)
def test_model_device_map(cuda, fsdp, processes, rank, expected):
    assert model_device_map(cuda, fsdp, processes, rank) == expected


def test_synced_generate_keeps_processes_stepping_together():
    from tes_grpo.sampler import SyncedGenerate

    calls = []
    synced = SyncedGenerate(lambda *args, **kwargs: calls.append(kwargs))
    synced(max_new_tokens=3)
    synced(synced_gpus=False)
    assert calls == [{"max_new_tokens": 3, "synced_gpus": True}, {"synced_gpus": False}]


# (processes, visible GPUs, refused)
VISIBLE_GPUS = [
    (1, 0, False),  # CPU
    (1, 1, False),  # one GPU
    (1, 2, True),  # one process, two GPUs: would be nn.DataParallel
    (2, 2, False),  # accelerate launch: one GPU per process
]


@pytest.mark.parametrize("processes, gpus, refused", VISIBLE_GPUS)
def test_one_process_sees_one_gpu(processes, gpus, refused):
    if refused:
        with pytest.raises(train_grpo.SettingsError, match="CUDA_VISIBLE_DEVICES=0.*accelerate launch"):
            check_visible_gpus(gpus, processes)
    else:
        check_visible_gpus(gpus, processes)


# (cuda, FSDP config, rank, loads the checkpoint's weights)
LOADS_WEIGHTS = [
    (False, False, 0, True),  # CPU, one process
    (True, False, 1, True),  # DDP: every GPU needs the whole model
    (True, True, 0, True),  # FSDP rank 0: the weights FSDP broadcasts
    (True, True, 1, False),  # FSDP rank 1: structure only
    (False, True, 1, True),  # FSDP config without GPUs: accelerate runs plain data parallelism
]


@pytest.mark.parametrize("cuda, fsdp, rank, loads", LOADS_WEIGHTS)
def test_loads_weights_here(cuda, fsdp, rank, loads):
    assert loads_weights_here(cuda, fsdp, 2, rank) is loads


@pytest.mark.slow
@pytest.mark.parametrize("experts", ["bf16", "mxfp4"])  # dequantized, or resident MXFP4 (mxfp4_experts.py)
def test_empty_model_has_the_loaded_models_structure_without_weights(experts):
    import torch

    loaded = load_training_model(resolve_model_path("tiny"), experts=experts)
    empty = empty_policy_model(resolve_model_path("tiny"), loaded.dtype,
                                          loaded.config._attn_implementation, experts)
    shapes = {n: (tuple(p.shape), p.dtype) for n, p in loaded.named_parameters()}
    assert {n: (tuple(p.shape), p.dtype) for n, p in empty.named_parameters()} == shapes
    assert all(p.device.type == "meta" for p in empty.parameters())
    loaded_buffers = dict(loaded.named_buffers())
    for name, buffer in empty.named_buffers():  # real, and equal: FSDP does not broadcast them
        # load_policy_model puts the loaded model on the GPU where there is one; compare the values on the CPU
        assert buffer.device.type == "cpu" and torch.equal(buffer, loaded_buffers[name].cpu()), name
    assert type(empty) is type(loaded) and empty.config.use_cache


# (rng files in the checkpoint, processes now, refused)
RESUME_PROCESSES = [
    (["rng_state.pth"], 1, False),  # one process wrote it, one resumes
    (["rng_state_0.pth", "rng_state_1.pth"], 2, False),
    (["rng_state_0.pth", "rng_state_1.pth"], 1, True),  # 2 wrote it: the stream's draws and RNG states differ
    (["rng_state.pth"], 2, True),
    ([], 2, False),  # no RNG state saved: nothing to compare
]


@pytest.mark.parametrize("files, processes, refused", RESUME_PROCESSES)
def test_resume_needs_the_same_number_of_processes(tmp_path, files, processes, refused):
    from tes_grpo.fileio import InputError

    for name in files:
        (tmp_path / name).write_bytes(b"")
    if refused:
        with pytest.raises(InputError, match="was written by"):
            check_resume_processes(tmp_path, processes)
    else:
        check_resume_processes(tmp_path, processes)


@pytest.mark.slow
def test_lora_weights_of_an_empty_model_get_their_own_storage():
    """accelerate maps optimizer parameters to FSDP shards by data_ptr(): meta tensors all have 0."""
    from peft import get_peft_model

    empty = empty_policy_model(resolve_model_path("tiny"), None, "eager")
    model = get_peft_model(empty, train_grpo.build_lora_config(4, 8))
    trainable = [p for p in model.parameters() if p.requires_grad]
    assert trainable and all(p.is_meta for p in trainable)
    assert give_trainable_weights_storage(model) == len(trainable)
    trainable = [p for p in model.parameters() if p.requires_grad]
    assert not any(p.is_meta for p in trainable)
    assert len({p.data_ptr() for p in trainable}) == len(trainable)
    assert all(p.is_meta for p in model.parameters() if not p.requires_grad)  # the base stays without weights
