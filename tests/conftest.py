"""Test-wide setup: everything offline and hermetic (corpus and HF caches in a session temp dir)."""
from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent


@pytest.fixture(scope="session", autouse=True)
def offline_env(tmp_path_factory: pytest.TempPathFactory):
    """No test may touch the network; caches live in a temp dir that subprocesses inherit too."""
    cache = tmp_path_factory.mktemp("cache")
    saved = dict(os.environ)
    os.environ.update({
        "SPES_CACHE_DIR": str(cache / "spes"),
        "HF_HOME": str(cache / "hf"),
        "HF_HUB_OFFLINE": "1",
        "HF_DATASETS_OFFLINE": "1",
        "TRANSFORMERS_OFFLINE": "1",
        "TOKENIZERS_PARALLELISM": "false",
    })
    yield cache
    os.environ.clear()
    os.environ.update(saved)


def peer_cmd(*args: str) -> list[str]:
    return [sys.executable, "-m", "peer.run", *args]
