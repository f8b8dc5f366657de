"""Shared pytest setup: GPU tests are skipped without a CUDA device."""

from __future__ import annotations

import os
import sys

import pytest

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _has_cuda() -> bool:
    try:
        import torch

        return torch.cuda.is_available()
    except Exception:
        return False


def pytest_collection_modifyitems(config, items):
    """Skip tests marked ``gpu`` when no CUDA device is present."""
    if _has_cuda():
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


@pytest.fixture
def shardscope_cmd():
    """The command prefix that runs the real command line in a subprocess."""
    return [sys.executable, "-m", "shardscope.cli"]
