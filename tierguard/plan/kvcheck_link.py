"""Tie the ladder's "kv_quantization" step to `tierguard kvcheck` (R7).

The ladder proposes KV quantization from memory arithmetic alone; R7 says quality must
be checked on long-context tasks first. This module:
- names the command that checks it (`kvcheck_command`), put on the step;
- reads a kvcheck result (`--kvcheck RESULT.json`) and marks the step "validated" when
  the result passes the dtype the ladder chose, "rejected" when it fails it, and
  "unchecked" when the result does not cover that dtype. A rejected step means the plan
  must not count on quantization: the caller re-plans without it (`cli/plan.py`).
"""

from __future__ import annotations

import json
from pathlib import Path

from tierguard.common.errors import TierguardError

STEP = "kv_quantization"


def kvcheck_dtype(fmt: str) -> str | None:
    """The engine KV dtype kvcheck runs for a plan format (fp8 variants -> fp8)."""
    name = fmt.lower()
    if name.startswith("fp8"):
        return "fp8"
    if name in ("int8", "q8_0"):
        return "int8"
    return None


def _k(tokens: int) -> str:
    return f"{tokens // 1024}k" if tokens % 1024 == 0 else str(tokens)


def kvcheck_command(model: str, fmt: str, contexts: list[int]) -> str:
    dtype = kvcheck_dtype(fmt) or "int8,fp8"
    ctx = ",".join(_k(c) for c in sorted(set(contexts))) or "1k,2k,4k,8k"
    return f"tierguard kvcheck --model {model} --kv-dtype {dtype} --contexts {ctx} --output-dir kvcheck"


def load_result(path: str | Path) -> dict:
    p = Path(path)
    try:
        doc = json.loads(p.read_text())
    except OSError as exc:
        raise TierguardError(f"--kvcheck {str(p)!r}: cannot read: {exc.strerror or exc}") from None
    except json.JSONDecodeError as exc:
        raise TierguardError(f"--kvcheck {str(p)!r} is not JSON: {exc.msg} at line {exc.lineno}") from None
    if not isinstance(doc, dict) or not str(doc.get("format", "")).startswith("tierguard-kvcheck/"):
        raise TierguardError(f"--kvcheck {str(p)!r} is not a `tierguard kvcheck --output-dir` result (kvcheck.json)")
    if not isinstance(doc.get("verdicts"), dict):
        raise TierguardError(f"--kvcheck {str(p)!r} has no verdicts")
    return doc


def annotate(plan: dict, model: str, result: dict | None = None, result_path: str | None = None) -> str | None:
    """Put the command (and the result's verdict) on the kv_quantization step.

    Returns the step's status ("validated", "rejected", "unchecked") or None when the
    ladder has no applied quantization step."""
    step = next((s for s in plan.get("ladder", []) if s.get("step") == STEP and s.get("applied")), None)
    if step is None:
        return None
    fmt = str(step.get("kv_dtype", ""))
    contexts = [int(c) for c in plan.get("kv", {}).get("per_sequence_bytes", {})] or []
    command = kvcheck_command(model, fmt, contexts)
    info: dict = {"command": command, "status": "unchecked"}
    dtype = kvcheck_dtype(fmt)
    if result is not None:
        verdict = result["verdicts"].get(dtype) if dtype else None
        info["result"] = result_path
        if verdict is None:
            info["why"] = f"the result does not cover {fmt} (it checked {', '.join(result['verdicts']) or 'nothing'})"
        else:
            info["status"] = "validated" if verdict.get("passed") else "rejected"
            info["contexts"] = result.get("contexts")
            info["failed_contexts"] = verdict.get("failed_contexts", [])
    step["kvcheck"] = info
    if info["status"] == "unchecked":
        step["detail"] += f"; check it: {command}"
    else:
        step["detail"] += f"; kvcheck {info['status']} {fmt} on {result.get('model')} ({result_path})"
    return info["status"]


def mark_rejected(plan: dict, model: str, result: dict, result_path: str, fmt: str) -> None:
    """After re-planning without quantization: say on the (skipped) step why."""
    step = next((s for s in plan.get("ladder", []) if s.get("step") == STEP), None)
    if step is None:
        return
    failed = result["verdicts"].get(kvcheck_dtype(fmt) or "", {}).get("failed_contexts", [])
    step["kvcheck"] = {"status": "rejected", "result": result_path, "failed_contexts": failed}
    step["detail"] = (
        f"KV as {fmt} rejected by kvcheck on {result.get('model')} ({result_path}: fails at "
        f"{', '.join(map(str, failed)) or '?'} tokens); not applied"
    )
