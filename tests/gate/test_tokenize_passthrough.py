"""/tokenize through the gate: a client that counts tokens (tierguard bench) gets the
replica's exact count instead of falling back to an estimate."""

from __future__ import annotations

import aiohttp

from tests.gate.helpers import GateProcess, run
from tierguard.bench.prompts import ServerPrompts
from tierguard.bench.schedule_server import ScheduleServer


def test_tokenize_is_answered_by_a_replica(tmp_path):
    with ScheduleServer(capacity=2, ttft_ms=5, itl_ms=5, output_tokens=4) as up, \
            GateProcess(up.base_url, "--api-key", "k1", jobs_dir=tmp_path / "jobs") as gate:
        async def main():
            async with aiohttp.ClientSession() as s:
                body = {"model": "m", "prompt": "one two three", "add_special_tokens": False}
                async with s.post(gate.url + "/tokenize", json=body) as r:
                    assert r.status == 401  # the gate's key still applies
                auth = {"Authorization": "Bearer k1"}
                async with s.post(gate.url + "/tokenize", json=body, headers=auth) as r:
                    direct = await (await s.post(up.base_url + "/tokenize", json=body)).json()
                    assert r.status == 200 and await r.json() == direct
                async with s.post(gate.url + "/tokenize", data=b"{not json", headers=auth) as r:
                    assert r.status == 400

        run(main())
        maker = ServerPrompts(gate.url, "m", {"Authorization": "Bearer k1"})
        assert maker.exact and maker.count(" the cat sat") == ServerPrompts(up.base_url, "m", {}).count(" the cat sat")
