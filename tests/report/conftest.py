from __future__ import annotations

import pytest
from sweep.fake_bench import ServerModel, flag, make_bench
from sweep.helpers import failing_variant, schedule_variant

from tierguard.sweep.matrix import parse_matrix
from tierguard.sweep.runner import Sweep

PROM = """# HELP tierguard_kv_host_tier_hits_total Host tier hits
# TYPE tierguard_kv_host_tier_hits_total counter
tierguard_kv_host_tier_hits_total 42.0
# HELP tierguard_queue_depth Waiting requests
# TYPE tierguard_queue_depth gauge
tierguard_queue_depth{pool="long"} 3.0
# HELP process_cpu_seconds_total CPU
# TYPE process_cpu_seconds_total counter
process_cpu_seconds_total 1.5
"""


@pytest.fixture(scope="session")
def run_dir(tmp_path_factory):
    """A finished sweep: two variants with known capacities (3 and 6), one that failed to
    start, and a prefix slice where "big" loads prefixes and "small" recomputes them."""
    d = tmp_path_factory.mktemp("run")
    caps = {"small": 3, "big": 6}
    m = parse_matrix(
        {
            "name": "report-test",
            "variants": [
                schedule_variant("small", 3, tags=["reference", "no-tier"]),
                failing_variant(),
                schedule_variant("big", 6, tags=["host-tier"]),
            ],
            "profile": {"context_lengths": [64, 256], "output_len": 16, "num_requests": 8},
            "slices": {
                "ladder": [1, 2, 4, 8],
                "mixed": {"short_len": 64, "long_len": 256, "concurrency": [2]},
                "prefix": {"context": 128, "num_prefixes": 2, "requests_per_prefix": 3, "concurrency": [2]},
            },
            "slo": {"p99_ttft_ms": 200, "p99_itl_ms": 50},
            "uncertainty": {"bootstrap": 50},
        }
    )

    def bench(argv, log, timeout):
        name = flag(argv, "--output-dir").split("/")[-3]
        # Prefix slice: "big" loads the prefix (prefills only the suffix), "small" recomputes it.
        per_token = 1.0 if "--prefix-len" in argv and name == "small" else 0.1
        return make_bench(ServerModel(capacity=caps[name], prefill_ms_per_token=per_token))(argv, log, timeout)

    Sweep(m, d, bench=bench).run()
    (d / "small" / "ladder-ctx64-c1" / "metrics.prom").write_text(PROM)
    return d
