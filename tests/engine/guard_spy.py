"""The cold contract's enforcement, checked from inside the engine: every step's scheduling
and model run happen under the decode guard, and no cold medium is ever read on the
engine thread (not in a step, not in `connector.poll()`): staging reads run on the
transfer worker's threads, outside any guard.

`GuardSpy` wraps public points of a built engine (the scheduler's `schedule`, the model
runner's `run`, the connector's `poll`, each cold medium's `read_many`) and records the
calling thread and `guard.decode_depth()` of every call, so these checks fail when the
engine stops entering the guard or when a read moves onto the engine thread; the
counters alone cannot see either (mutants in tests/test_mutations.py show it). `off_engine`
names more points that must never run on the engine thread (a remote medium's Redis
client: any round trip there is a network wait inside the engine's loop). Used by
tests/engine/test_tiers.py on its disk and naive workloads and by
tests/engine/test_remote_tier_engine.py on Redis.
"""

from __future__ import annotations

import threading
from collections import defaultdict
from dataclasses import dataclass
from typing import Any

from tierguard.kv.guard import decode_depth


@dataclass(frozen=True)
class Call:
    thread: int
    depth: int


class GuardSpy:
    """Records (thread, decode depth) of calls to an engine's public step points and to its
    cold media's reads. `extra` adds more (name, object, method) points to watch;
    `off_engine` adds points that `assert_contract` keeps off the engine thread."""

    def __init__(self, engine: Any, extra: tuple[tuple[str, Any, str], ...] = (),
                 off_engine: tuple[tuple[str, Any, str], ...] = ()) -> None:
        self.calls: dict[str, list[Call]] = defaultdict(list)
        self.off_engine = [name for name, _obj, _attr in off_engine]
        points = [("schedule", engine.scheduler, "schedule"), ("run", engine.runner, "run"),
                  ("poll", engine.connector, "poll")]  # fmt: skip
        points += [
            (f"{name}.read_many", m, "read_many")
            for name, m in getattr(engine.connector, "media", {}).items()
        ]
        for name, obj, attr in [*points, *extra, *off_engine]:
            self._wrap(name, obj, attr)

    def _wrap(self, name: str, obj: Any, attr: str) -> None:
        original = getattr(obj, attr)
        calls = self.calls[name]

        def spy(*args: Any, **kwargs: Any) -> Any:
            calls.append(Call(threading.get_ident(), decode_depth()))
            return original(*args, **kwargs)

        setattr(obj, attr, spy)  # an instance attribute: the engine calls obj.attr(...)

    def engine_thread(self) -> int:
        threads = {c.thread for c in self.calls["schedule"]}
        assert len(threads) == 1, f"the engine stepped on {len(threads)} threads"
        return threads.pop()

    def assert_contract(self, read_media: tuple[str, ...] = ()) -> None:
        """Every schedule and model run inside the guard; every cold read off the engine
        thread and outside any guard; the media in `read_media` were actually read."""
        engine_thread = self.engine_thread()
        for point in ("schedule", "run"):
            calls = self.calls[point]
            assert calls, f"the engine never called {point}: the spy is not on the step's path"
            outside = [c for c in calls if c.depth < 1]
            assert not outside, f"{len(outside)} of {len(calls)} {point} calls ran outside the decode guard"
            assert {c.thread for c in calls} == {engine_thread}
        assert self.calls["poll"] and {c.thread for c in self.calls["poll"]} == {engine_thread}
        for name, calls in self.calls.items():
            if not name.endswith(".read_many"):
                continue
            on_engine = [c for c in calls if c.thread == engine_thread]
            assert not on_engine, f"{name} ran {len(on_engine)} times on the engine thread"
            assert all(c.depth == 0 for c in calls), f"{name} ran inside a decode guard"
        for name in self.off_engine:
            on_engine = [c for c in self.calls[name] if c.thread == engine_thread]
            assert not on_engine, f"{name} ran {len(on_engine)} times on the engine thread"
        for name in read_media:
            assert self.calls[f"{name}.read_many"], f"the {name} tier was never read: nothing was checked"
