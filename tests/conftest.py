"""Fixtures shared by several test modules, and the hooks of CI's check on skips and counts (skip_check.py)."""

import pytest
import torch
from skip_check import pytest_addoption, pytest_configure  # noqa: F401  (CI's skip and count check)


@pytest.fixture(scope="module")
def one_torch_thread():
    # the tiny model's ops are tiny: one thread is as fast and avoids OpenMP spin-waits on a shared, busy CPU
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture(scope="session")
def tokenizer():
    """gpt-oss's tokenizer from harmony (GPT_OSS_TOKENIZER or ../shared/gpt-oss-tokenizer)."""
    from tes_grpo.task.harmony import load_tokenizer

    return load_tokenizer()
