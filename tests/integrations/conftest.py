"""The real-vLLM tests need `.venv-vllm` at the repository root (`make vllm` creates it):
without it they skip and say so, except under CI=true, where a missing vLLM is a failure
(CI's full run must exercise the connector inside vLLM)."""

from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
sys.path.append(str(ROOT / "bench"))  # vllm_connector_common, tier_common


@pytest.fixture(scope="session")
def vllm_ready() -> None:
    from vllm_connector_common import vllm_missing

    why = vllm_missing()
    if why is None:
        return
    if os.environ.get("CI", "").lower() == "true":
        pytest.fail(f"CI runs the real-vLLM tests: {why}")
    pytest.skip(why)
