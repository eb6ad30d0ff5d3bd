"""Suite-wide set-up: W&B off, GPU tests skipped without CUDA, the one-thread fixture.

Shared builders live in ``helpers.py`` and ``runs.py`` (importable by every test module)."""

import os

import pytest
import torch

os.environ.setdefault("WANDB_MODE", "disabled")


def pytest_collection_modifyitems(config, items):
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs CUDA")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


@pytest.fixture(scope="module")
def one_thread():
    """Models this small are dispatch-bound: extra threads only add sync cost on shared cores."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)
