"""Settings, files and runs: what every script needs before any model is loaded (none of it imports torch at
import time).

- script_config: --NAME=value overrides resolved once into one Settings object; the settings table's choices
- presets: the MODEL_ID=tiny preset train_grpo.py and step_stream.py share
- choices: the training settings' fixed value sets
- fileio: the one CSV reader, atomic writes, input errors that name file, row, column and value
- run_folder: checkpoints, resume (torn files included), log trimming, how a stopped run goes on, the best
  checkpoint's record
- adapter_folder: what an adapter folder says: the one check evaluation and export run, its base model, the training
  run's settings that evaluation follows, `<run>/best`
- sources: where a model or tokenizer comes from (a folder, tiny, the Hub or its cache), checked in a second
- train_settings: train_grpo.py's settings rules that need no library, and the environment it reads
- callbacks: metrics.jsonl, one progress line per step, zero-padded checkpoint names, evaluation's checkpoint,
  best record and plot
- evaluation: evaluation during training: the held-out rows, the schedule, TRL's evaluation arguments
- plot: training.png, the run's reward, valid and optimal share per step and at each evaluation
- processes: rank-aware helpers for accelerate launch, and saying a thing once
- trackers: where the metrics go besides metrics.jsonl (REPORT_TO)
- oom: a run out of GPU memory: one message naming the step, the setting to lower and where --RESUME=1 continues
  (it imports transformers: train_grpo.py imports it after its start-up checks)
- hub_upload: an exported folder's Hub upload, checked before the export, the token never printed
"""
