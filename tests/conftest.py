"""Shared fixtures: the tiny demo checkpoint, built once per test session."""
import asyncio
import os

import pytest

os.environ.setdefault("OMP_NUM_THREADS", "1")


@pytest.fixture(scope="session")
def tiny_checkpoint(tmp_path_factory):
    """The demo's tiny Qwen3-MoE (random init) as an HF checkpoint directory."""
    from megarl.models.tiny_moe import make_tiny_moe

    return str(make_tiny_moe(tmp_path_factory.mktemp("tiny_moe")))


@pytest.fixture(scope="module")
def loop():
    """One event loop per module: an HTTP client's connections belong to the loop that made them."""
    loop = asyncio.new_event_loop()
    yield loop
    loop.close()
