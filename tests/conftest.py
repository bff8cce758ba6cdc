"""Shared test fixtures: paths to the repo, the interpreter running the tests, and the trainer tests' inputs."""

from __future__ import annotations

import os
import signal
import sys
from pathlib import Path

import pytest

REPO_ROOT = Path(__file__).resolve().parent.parent
if str(REPO_ROOT) not in sys.path:
    sys.path.insert(0, str(REPO_ROOT))

# Tests never reach a hub: anything that tries fails fast instead of hanging.
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")


@pytest.fixture(scope="session")
def repo_root() -> Path:
    return REPO_ROOT


@pytest.fixture(scope="session")
def python_exe() -> str:
    return sys.executable


@pytest.fixture(scope="session")
def inputs(tmp_path_factory) -> tuple[Path, Path]:
    """The dataset (with a validation split) and tiny bf16 Llama with weights that the trainer tests share;
    built once per session. Tests read them and write only under their own folders."""
    from tests.fsdp_helpers import make_dataset, make_model

    root = tmp_path_factory.mktemp("inputs")
    return make_dataset(root / "corpus"), make_model(root / "model", with_weights=True, dtype="bfloat16")


@pytest.fixture
def ctrl_c_raises():
    """Python leaves SIGINT ignored when it starts with it ignored (a background job, as CI may run the suite): a test
    of Ctrl-C gets the handler a terminal's Ctrl-C meets, KeyboardInterrupt, and the previous one back after."""
    previous = signal.signal(signal.SIGINT, signal.default_int_handler)
    yield
    signal.signal(signal.SIGINT, previous)
