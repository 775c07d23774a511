"""Fleet options: several upstreams, routing and shared-state settings are checked at the edge."""

from __future__ import annotations

import pytest

from tierguard.cli.main import main
from tierguard.common.errors import TierguardError
from tierguard.gate.policy import build_settings, load_config


def test_several_upstreams_from_flags_and_from_a_config_list(tmp_path):
    s = build_settings({"upstream": ["http://a:1/v1/", "http://b:2"], "route": "round-robin"})
    assert s.upstreams == ["http://a:1", "http://b:2"] and s.upstream == "http://a:1"
    cfg = tmp_path / "g.yaml"
    cfg.write_text("upstream: [http://a:1, http://b:2, http://c:3]\nroute: prefix\nroute_beta: 1.5\n"
                   "shared_state: redis://127.0.0.1:6379/2\nlease_ms: 3000\n")
    s = build_settings(load_config(str(cfg)))
    assert len(s.upstreams) == 3 and s.route_beta == 1.5 and s.shared_state.endswith("/2") and s.lease_ms == 3000
    assert build_settings({"upstream": "http://a:1"}).upstreams == ["http://a:1"]  # one upstream, as before


@pytest.mark.parametrize("bad, words", [
    ({"upstream": ["http://a:1", "ftp://b"]}, "http"),
    ({"upstream": ["http://a:1", "http://a:1/"]}, "twice"),
    ({"route": "random"}, "route must be one of"),
    ({"route_beta": -0.1}, "route_beta"),
    ({"route_imbalance": -1}, "route_imbalance"),
    ({"route_index_entries": 0}, "route_index_entries"),
    ({"health_interval_s": 0}, "health_interval_s"),
    ({"eject_after": 0}, "eject_after"),
    ({"shared_state": "http://127.0.0.1:6379"}, "redis://"),
    ({"shared_state": "redis://x", "lease_ms": 200, "shared_timeout_ms": 100}, "too short"),
    ({"shared_gates": 0}, "shared_gates"),
])
def test_bad_fleet_values_are_named(bad, words):
    with pytest.raises(TierguardError, match=words):
        build_settings({"upstream": "http://127.0.0.1:9", **bad})


def test_cli_refuses_bad_fleet_flags_in_one_line(capsys):
    assert main(["gate", "--upstream", "http://127.0.0.1:9", "--route", "sticky"]) == 2
    err = capsys.readouterr().err
    assert "--route must be one of prefix, least-loaded, round-robin" in err and "Traceback" not in err
    assert main(["gate", "--upstream", "http://127.0.0.1:9", "--shared-state", "127.0.0.1:6379"]) == 2
    assert "--shared-state must be a redis:// URL" in capsys.readouterr().err
