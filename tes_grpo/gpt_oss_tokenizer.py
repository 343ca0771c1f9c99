"""Where the gpt-oss tokenizer comes from, and OpenAI's Harmony encoding, both offline-capable.

`GPT_OSS_TOKENIZER` (environment) names a local folder or hub id. Unset, the project uses
`../shared/gpt-oss-tokenizer` beside the repo when it exists, else the hub id `openai/gpt-oss-20b`,
and says which it chose.
"""

from __future__ import annotations

import functools
import os
import sys
from pathlib import Path

HUB_ID = "openai/gpt-oss-20b"
REPO_ROOT = Path(__file__).resolve().parents[1]
SHARED_TOKENIZER = REPO_ROOT.parent / "shared" / "gpt-oss-tokenizer"


def tokenizer_source() -> str:
    """Local folder or hub id of the gpt-oss tokenizer (see module docstring)."""
    env = os.environ.get("GPT_OSS_TOKENIZER")
    if env:
        return env
    if SHARED_TOKENIZER.is_dir():
        return str(SHARED_TOKENIZER)
    print(f"note: no local tokenizer at {SHARED_TOKENIZER} and GPT_OSS_TOKENIZER unset; "
          f"using the hub id {HUB_ID}", file=sys.stderr)
    return HUB_ID


@functools.lru_cache(maxsize=4)
def load_tokenizer(source: str | None = None):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(source or tokenizer_source())


@functools.lru_cache(maxsize=1)
def harmony_encoding():
    """OpenAI's Harmony encoding for gpt-oss; reads o200k_base from the local tokenizer folder if any."""
    source = Path(tokenizer_source())
    if (source / "o200k_base.tiktoken").is_file() and "TIKTOKEN_ENCODINGS_BASE" not in os.environ:
        os.environ["TIKTOKEN_ENCODINGS_BASE"] = str(source.resolve())
    from openai_harmony import HarmonyEncodingName, load_harmony_encoding

    return load_harmony_encoding(HarmonyEncodingName.HARMONY_GPT_OSS)
