"""Generate TES operator decisions with the merged MXFP4 export and print each action with its final answer.

    python run_exported_model.py --MODEL_ID=runs/export/gpt-oss-tes-mxfp4 --PROMPT_PATH=data/eval --MAX_ROWS=5

`PROMPT_PATH` is a Harmony CSV (`*_q_dataset_harmony.csv`, its `prompt` already rendered by the chat template
with the generation prompt) or a folder of them. The action is read with the training reward's parser
(`harmony.parse_action`: the last `[k]` in the final channel, None when invalid or cut off). MAX_COMPLETION_LEN
and TEMPERATURE follow the training run ("auto": the train_config.json the export carries), as they would in
training.
The export loads as training and the evaluation scripts load a checkpoint (model_loading.load_for_inference): its
MXFP4 experts stay resident as MXFP4 on any device (DEQUANTIZE=1: dequantized to bf16 at load); the script prints
which path was taken.
"""

from __future__ import annotations

import sys
from pathlib import Path

MODEL_ID = "runs/export/gpt-oss-tes-mxfp4"  # merged export folder (export_quantized_model.py's OUT_DIR) or hub id
PROMPT_PATH = "data/eval"  # Harmony CSV, or a folder whose *_harmony.csv files are read in name order
MAX_ROWS = 5  # prompts to answer (first rows of the sorted files); 0 = all
MAX_COMPLETION_LEN = "auto"  # tokens per completion; auto = the training run's; a completion cut here is invalid
DO_SAMPLE = True  # sample (gpt-oss's recommended T=1, top_p=1) or decode greedily
TEMPERATURE = "auto"  # sampling temperature; auto = the training run's
TOP_P = 1.0  # nucleus sampling mass
SEED = 0  # torch seed for sampling
DEQUANTIZE = False  # True: load the experts dequantized to bf16; False: keep them resident as MXFP4
DEVICE = "auto"  # "auto" (cuda when available), "cpu" or "cuda"
OUT_DIR = ""  # also write OUT_DIR/decisions.csv (row, action, optimal_action, completion); "" = print only

FINAL_PREVIEW_CHARS = 200  # characters of each final answer printed on screen (the CSV keeps all)


def load_prompts(path: str | Path, max_rows: int):
    """DataFrame with `source`, `row`, `prompt` (+ `optimal_action` when present), at most `max_rows` rows."""
    import pandas as pd

    from tes_grpo.model.llm_policy import prompt_files
    from tes_grpo.run.fileio import InputError, read_csv_table
    from tes_grpo.task.harmony import prompt_problem

    frames = []
    for file in prompt_files(path):
        frame = read_csv_table(file)
        if "prompt" not in frame.columns:
            raise InputError(file, f"no 'prompt' column (columns: {', '.join(frame.columns)})")
        for index, prompt in frame["prompt"].items():
            problem = prompt_problem(prompt)
            if problem is not None:
                raise InputError(file, f"{problem}; use the *_harmony.csv files", row=index + 1, column="prompt")
        if "optimal_action" in frame.columns:
            frame["optimal_action"] = pd.to_numeric(frame["optimal_action"], errors="coerce")
        frame = frame.assign(source=str(file), row=frame.index + 1)  # data row (1 = first after the header)
        frames.append(frame)
        if max_rows and sum(len(f) for f in frames) >= max_rows:
            break
    prompts = pd.concat(frames, ignore_index=True)
    return prompts.head(max_rows) if max_rows else prompts


def sampling_settings(s) -> tuple[int, float]:
    """(MAX_COMPLETION_LEN, TEMPERATURE) with "auto" taken from the training run the export records; says where each
    came from."""
    from tes_grpo.run.adapter_folder import checked_training_settings

    values = checked_training_settings(s, ("MAX_COMPLETION_LEN", "TEMPERATURE"), s.MODEL_ID)
    return values["MAX_COMPLETION_LEN"], values["TEMPERATURE"]


def load_model(model_id: str, dequantize: bool, device: str):
    """(model, tokenizer, description of how the experts were loaded)."""
    import torch

    from tes_grpo.model.model_loading import load_for_inference, load_tokenizer_for, resolve_attention, resolve_device

    tokenizer = load_tokenizer_for(model_id)  # before the (slow) model: a missing tokenizer stops here
    device = resolve_device(device)
    model, how, _ = load_for_inference(model_id, device, torch.bfloat16, resolve_attention("auto", device),
                                       experts="bf16" if dequantize else "auto")
    return model, tokenizer, how


def final_answer(text: str) -> str | None:
    """The last final-channel message of a Harmony completion (to its end marker or the end of text)."""
    from tes_grpo.task.harmony import final_message

    final = final_message(text)
    return None if final is None else final[0]


def generate_completions(model, tokenizer, prompts: list[str], max_new_tokens: int, do_sample: bool,
                         temperature: float, top_p: float, seed: int) -> list[str]:
    """One completion per prompt, decoded with its Harmony special tokens kept."""
    import torch
    from tqdm import tqdm

    torch.manual_seed(seed)
    texts = []
    for prompt in tqdm(prompts, desc="generating", unit="prompt"):
        # the Harmony prompt already holds every special token; adding BOS would change it
        inputs = tokenizer(prompt, return_tensors="pt", add_special_tokens=False).to(model.device)
        sampling = {"temperature": temperature, "top_p": top_p} if do_sample else {}
        with torch.no_grad():
            output = model.generate(**inputs, max_new_tokens=max_new_tokens, do_sample=do_sample, **sampling)
        texts.append(tokenizer.decode(output[0, inputs.input_ids.shape[1]:], skip_special_tokens=False))
    return texts


def decisions(prompts, texts: list[str]):
    """Adds `completion`, `action` (None when invalid) and `final_answer` to the prompts frame."""
    from tes_grpo.task.harmony import parse_action

    result = prompts.copy()
    result["completion"] = texts
    result["action"] = [parse_action(text) for text in texts]
    result["final_answer"] = [final_answer(text) for text in texts]
    return result


def print_decisions(result) -> None:
    for record in result.itertuples():
        action = "invalid" if record.action is None or record.action != record.action else f"[{int(record.action)}]"
        optimal = f", optimal [{int(record.optimal_action)}]" if "optimal_action" in result.columns else ""
        answer = record.final_answer if isinstance(record.final_answer, str) else "(no final answer)"
        answer = answer.strip().replace("\n", " ")[:FINAL_PREVIEW_CHARS]
        print(f"{Path(record.source).name} row {record.row}: action {action}{optimal} | final: {answer}")
    valid = result["action"].notna().sum()
    print(f"{valid}/{len(result)} valid answers")


def main(argv: list[str] | None = None) -> int:
    from tes_grpo.run.fileio import InputError, write_csv_atomic
    from tes_grpo.run.script_config import resolve
    from tes_grpo.run.sources import check_model_id

    s = resolve(globals(), argv)
    try:
        check_model_id(s.MODEL_ID, local="give the folder export_quantized_model.py wrote (its OUT_DIR) or a Hub id")
        max_new_tokens, temperature = sampling_settings(s)
        prompts = load_prompts(s.PROMPT_PATH, s.MAX_ROWS)
        model, tokenizer, path = load_model(s.MODEL_ID, s.DEQUANTIZE, s.DEVICE)
    except (InputError, ValueError, OSError) as err:
        print(f"error: {err}", file=sys.stderr)
        return 1
    print(f"model {s.MODEL_ID}: {path}")
    texts = generate_completions(model, tokenizer, list(prompts["prompt"]), max_new_tokens, s.DO_SAMPLE,
                                 temperature, s.TOP_P, s.SEED)
    result = decisions(prompts, texts)
    print_decisions(result)
    if s.OUT_DIR:
        wanted = ("source", "row", "optimal_action", "action", "final_answer", "completion")
        columns = [c for c in wanted if c in result]
        out = write_csv_atomic(result[columns], Path(s.OUT_DIR) / "decisions.csv")
        print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
