"""AsyncLLMEngine: the engine loop in a background thread, outputs delivered to asyncio.

The thread owns the LLMEngine exclusively; the asyncio side talks to it only through a
command queue (add / abort), and the thread hands outputs back with
`loop.call_soon_threadsafe` to the loop each request was made from (so one engine can
outlive an event loop, e.g. across `asyncio.run` calls in tests). `generate` yields exactly one finished output, last; if its
consumer is cancelled (client gone), the request is aborted and its blocks freed.

Failures: a request whose own work fails in the engine (LLMEngine's isolation) gets its
exception and the thread goes on. A failure the engine cannot pin on one request ends the
thread: every request it knew of, queued in a command or running, gets EngineDeadError,
so no consumer waits for an output that never comes; `failure()` names the error from
then on (serve's /health answers 503 with it) and every later `generate` raises at once.
"""

from __future__ import annotations

import asyncio
import logging
import queue
import threading
from collections.abc import AsyncIterator, Callable
from pathlib import Path
from typing import Any

from tierguard.common.errors import TierguardError
from tierguard.engine.api import (
    EngineDeadError,
    EngineStats,
    RequestFailed,
    RequestOutput,
    SamplingParams,
    StepStats,
)
from tierguard.engine.llm_engine import LLMEngine

log = logging.getLogger(__name__)

# Stats are taken after every step; tier percentiles are not free, so they may be this old.
STATS_MAX_AGE_S = 0.1


class AsyncLLMEngine:
    def __init__(self, engine: LLMEngine) -> None:
        self.engine = engine
        self.model_name = engine.model_name
        self.max_model_len = engine.config.max_model_len
        self.vocab_size = engine.model_config.vocab_size
        self.tokenizer = engine.tokenizer
        self._commands: queue.SimpleQueue = queue.SimpleQueue()
        # request id -> (the loop its consumer runs on, its output queue)
        self._queues: dict[str, tuple[asyncio.AbstractEventLoop, asyncio.Queue]] = {}
        self._thread: threading.Thread | None = None
        self._stopping = threading.Event()
        self._stats = engine.stats()  # refreshed by the engine thread after every step
        self._error: BaseException | None = None
        # Held while a consumer registers and while a dying thread takes the consumers to
        # fail, so none registers unseen after the engine stopped.
        self._lock = threading.Lock()

    @classmethod
    def from_model_dir(cls, model_dir: str | Path, **options: Any) -> AsyncLLMEngine:
        """Load a local HF model directory.

        `options` are `build_engine`'s keyword arguments (tierguard/engine/factory.py):
        dtype, device, the KV budget, batching limits, tiers, kv_dtype, weight offload.
        """
        from tierguard.engine.factory import build_engine

        return cls(on_own_thread(lambda: build_engine(model_dir, **options)))

    # -- lifecycle ------------------------------------------------------------------------
    async def start(self) -> None:
        if self._thread is not None:
            return
        self._stopping.clear()
        self._thread = threading.Thread(target=self._run, name="tierguard-engine", daemon=True)
        self._thread.start()

    async def shutdown(self) -> None:
        if self._thread is None:
            return
        self._stopping.set()
        self._commands.put(("wake", None, None))
        await asyncio.to_thread(self._thread.join)
        self._thread = None

    # -- requests -------------------------------------------------------------------------
    async def generate(
        self,
        request_id: str,
        prompt_token_ids: list[int],
        params: SamplingParams,
        request_class: str = "interactive",
    ) -> AsyncIterator[RequestOutput]:
        if self._thread is None:
            await self.start()
        if request_id in self._queues:
            raise TierguardError(f"request id {request_id!r} is already in flight")
        self.engine.validate(prompt_token_ids, params)  # reads config only; safe from this thread
        q: asyncio.Queue = asyncio.Queue()
        with self._lock:
            why = self.failure()
            if why is not None:
                raise EngineDeadError(why)
            self._queues[request_id] = (asyncio.get_running_loop(), q)
        self._commands.put(("add", request_id, (list(prompt_token_ids), params, request_class)))
        finished = False
        try:
            while True:
                item = await q.get()
                if isinstance(item, BaseException):
                    finished = True
                    raise item
                finished = item.finished
                yield item
                if finished:
                    return
        finally:
            self._queues.pop(request_id, None)
            if not finished:
                self._commands.put(("abort", request_id, None))

    async def abort(self, request_id: str) -> None:
        self._commands.put(("abort", request_id, None))

    def stats(self) -> EngineStats:
        return self._stats

    def failure(self) -> str | None:
        """Why the engine stopped serving, naming the error; None while it serves."""
        if self._error is not None:
            return f"engine stopped after an error: {type(self._error).__name__}: {self._error}"
        thread = self._thread
        if thread is not None and not thread.is_alive() and not self._stopping.is_set():
            return "the engine thread exited"
        return None

    def tier_health(self) -> dict | None:
        """The cold tiers' state for /health (None without tiers): `healthy` overall, and
        per medium `<name>_tier`, `<name>_healthy`, `<name>_reason`. Reads plain fields."""
        media = self.engine.connector.health()
        if media is None:
            return None
        out: dict = {"healthy": all(ok for ok, _ in media.values())}
        for name, (ok, reason) in media.items():
            out.update({f"{name}_tier": True, f"{name}_healthy": ok, f"{name}_reason": reason})
        return out

    def add_step_listener(self, fn: Callable[[StepStats], None]) -> None:
        """`fn` runs on the engine thread after every step; keep it cheap and thread-safe."""
        self.engine.add_step_listener(fn)

    # -- engine thread --------------------------------------------------------------------------
    def _run(self) -> None:
        engine = self.engine
        while not self._stopping.is_set():
            try:
                self._drain(block=not engine.has_unfinished())
                if self._stopping.is_set():
                    break
                if engine.has_unfinished():
                    outputs = engine.step()
                    self._stats = engine.stats(STATS_MAX_AGE_S)
                    if outputs:
                        self._deliver(outputs)
                else:  # idle: a tier's state still changes (a remote index refresh, Redis down)
                    self._stats = engine.stats()
            except Exception as exc:  # not one request's: fail every request, keep no zombies
                log.exception("engine step failed; the engine stops and fails every request it holds")
                self._fail_all(exc)
                return
        for rid in list(engine.seqs):
            engine.abort(rid)
        try:
            engine.close()  # lets write-behind to the disk tier finish, bounded
        except Exception:  # shutdown must not hang or raise on a broken tier
            log.exception("closing the KV tiers failed")

    def _drain(self, block: bool) -> None:
        while True:
            try:
                kind, rid, payload = self._commands.get(timeout=0.5) if block else self._commands.get_nowait()
            except queue.Empty:
                return
            block = False
            if kind == "add":
                prompt, params, request_class = payload
                try:
                    self.engine.add_request(rid, prompt, params, request_class)
                except TierguardError as exc:  # the input: refused
                    self._deliver_error(rid, exc)
                except Exception as exc:  # adding this one request failed; it left nothing behind
                    log.exception("adding request %s failed; the engine serves the others on", rid)
                    self._deliver_error(rid, RequestFailed(f"the engine could not add this request "
                                                           f"({type(exc).__name__}: {exc})"))
            elif kind == "abort":
                out = self.engine.abort(rid)
                if out is not None:
                    self._deliver([out])
                    self._stats = self.engine.stats(STATS_MAX_AGE_S)

    def _deliver(self, outputs: list[RequestOutput]) -> None:
        """Engine thread: hand outputs to their consumers' loops, one wake-up per loop."""
        by_loop: dict[asyncio.AbstractEventLoop, list] = {}
        for out in outputs:
            entry = self._queues.get(out.request_id)
            if entry is not None:  # a failed request's consumer gets its exception
                by_loop.setdefault(entry[0], []).append((entry[1], out if out.error is None else out.error))
        for loop, items in by_loop.items():
            if not loop.is_closed():
                try:
                    loop.call_soon_threadsafe(_put_all, items)
                except RuntimeError:  # the loop closed in between
                    pass

    def _deliver_error(self, rid: str, exc: BaseException) -> None:
        entry = self._queues.get(rid)
        if entry is not None and not entry[0].is_closed():
            try:
                entry[0].call_soon_threadsafe(entry[1].put_nowait, exc)
            except RuntimeError:
                pass

    def _fail_all(self, exc: BaseException) -> None:
        """Engine thread, dying: every consumer gets EngineDeadError, those whose request was
        already in the engine with `started=True`, those still in the command queue without."""
        with self._lock:
            self._error = exc
            consumers = list(self._queues)
        why = self.failure() or str(exc)
        started = set(self.engine.seqs)
        for rid in list(self.engine.seqs):
            try:
                self.engine.abort(rid)
            except Exception:  # the pool may be inconsistent after the failure
                pass
        for rid in consumers:
            self._deliver_error(rid, EngineDeadError(why, started=rid in started))


def on_own_thread(fn: Callable[[], Any]) -> Any:
    """fn() on a thread that exits when it returns; its result, or its exception re-raised.

    Why: libgomp (torch's, which our kernels share) gives every thread that starts a
    parallel region its own pool of workers, and the pool lives as long as that thread.
    Once the pools hold more threads than there are CPUs, every OpenMP barrier spins only
    about a thousand times before it sleeps on a futex. Loading a model runs OpenMP work
    (quantization, torch ops). Done on the main thread, which never exits, its pool stays
    and puts the engine thread's team over that count: its threads then sleep and wake
    at every barrier, and a step with a prefill chunk costs markedly more per row than
    in-process. A thread that exits frees its pool, so the engine thread's team is the
    only one.
    """
    box: dict[str, Any] = {}

    def target() -> None:
        try:
            box["value"] = fn()
        except BaseException as exc:  # noqa: BLE001 - re-raised on the caller's thread
            box["error"] = exc

    t = threading.Thread(target=target, name="tierguard-load", daemon=True)  # Ctrl-C during a load exits
    t.start()
    t.join()
    if "error" in box:
        raise box["error"]
    return box["value"]


def _put_all(items: list) -> None:
    for q, item in items:
        q.put_nowait(item)
