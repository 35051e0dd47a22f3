from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "examples"))

# The article's reference model: P = 25,175,040 parameters.
SEED_P = 25_175_040
SEED_WEIGHTS = 4 * SEED_P  # 100,700,160
SEED_SAVED_PER_SAMPLE = (4096 + 4096 + 1024) * 4  # relu1, relu2 outputs and the final output (for pow)


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs CUDA")
    for item in items:
        if "cuda" in item.keywords:
            item.add_marker(skip)
