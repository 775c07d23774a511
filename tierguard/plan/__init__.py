"""`tierguard plan`: exact memory accounting, budgets and the remedy ladder (R1-R3, R6, R7).

Python API: `make_plan(PlanInputs(model="meta-llama/Llama-3.1-8B", gpu="H100-80GB"))`
returns the same dict `tierguard plan --json` prints.
"""

from __future__ import annotations

from tierguard.plan.catalogue import load_model
from tierguard.plan.config import ModelSpec, parse_config
from tierguard.plan.planner import PlanInputs, make_plan

__all__ = ["ModelSpec", "PlanInputs", "load_model", "make_plan", "parse_config"]
