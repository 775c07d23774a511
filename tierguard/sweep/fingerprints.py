"""Refuse to compare runs whose workload profiles differ (R10), naming the difference.

Each bench run records a profile fingerprint in run.json (identical profiles <=>
identical fingerprints). Within a sweep, the same cell of every variant must carry the
same fingerprint; when two differ we diff the recorded profiles so the message says
which setting changed, not just that two hashes disagree.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from tierguard.common.errors import TierguardError
from tierguard.sweep.matrix import Matrix
from tierguard.sweep.results import read_json

PROFILE_KEYS = ("profile", "workload")
# Settings in run.json's config that do not change the load (the bench leaves them out
# of its fingerprint too): where the server is, where results go, client tuning.
NOT_PROFILE = {
    "base_url",
    "output_dir",
    "api_key",
    "workers",
    "timeout",
    "show_progress",
    "scrape_interval_s",
    "max_send_lateness_ms",
    "max_loop_lag_ms",
    "max_client_cpu_util",
    "slo",
}


def recorded_profile(result_dir: Path) -> dict[str, Any]:
    """What defined the workload of a bench run: its config without client-side settings,
    the model name requested and how prompts were built."""
    run = read_json(result_dir / "run.json") or {}
    for key in PROFILE_KEYS:
        if isinstance(run.get(key), dict):
            return run[key]
    cfg = run.get("config")
    out = {k: v for k, v in cfg.items() if k not in NOT_PROFILE} if isinstance(cfg, dict) else {}
    if "model" in run:
        out["model"] = run["model"]
    if isinstance(run.get("prompts"), dict):
        out["prompts"] = run["prompts"]
    return out


def diff_profiles(a: dict[str, Any], b: dict[str, Any], prefix: str = "") -> list[str]:
    """Human-readable differences between two profile dicts: 'key: A != B'."""
    out: list[str] = []
    for key in sorted(set(a) | set(b)):
        va, vb = a.get(key), b.get(key)
        name = f"{prefix}{key}"
        if isinstance(va, dict) and isinstance(vb, dict):
            out.extend(diff_profiles(va, vb, name + "."))
        elif va != vb:
            out.append(f"{name}: {va!r} != {vb!r}")
    return out


def compare_result_dirs(a: Path, b: Path) -> None:
    """Raise TierguardError when two bench results were produced by different profiles."""
    from tierguard.sweep.cells import read_fingerprint

    fa, fb = read_fingerprint(a), read_fingerprint(b)
    if fa is None or fb is None or fa == fb:
        return
    diffs = diff_profiles(recorded_profile(a), recorded_profile(b))
    what = "; ".join(diffs[:6]) if diffs else f"fingerprint {fa} != {fb}"
    raise TierguardError(f"refusing to compare {a} with {b}: their workload profiles differ ({what})")


def check_same_profile(
    run_dir: Path, matrix: Matrix, variant: str, key: str, fingerprint: str | None, state: dict
) -> None:
    """Compare this cell's fingerprint with the same cell of every other variant."""
    if fingerprint is None:
        return
    for other in matrix.variants:
        if other.name == variant:
            continue
        rec = state.get("cells", {}).get(other.name, {}).get(key)
        if rec and rec.get("fingerprint") and rec["fingerprint"] != fingerprint:
            compare_result_dirs(run_dir / other.name / key / "r0", run_dir / variant / key / "r0")
            raise TierguardError(
                f"refusing to compare {variant} with {other.name} at {key}: "
                f"profile fingerprints differ ({rec['fingerprint']} != {fingerprint})"
            )
