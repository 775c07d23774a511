"""The aiohttp application: routes, API-key check, and one error shape for everything.

`create_app(engine)` is all a caller needs: the app starts the engine when it starts
and shuts it down on cleanup (unless `manage_engine=False`), so the CLI, the tests
and the demo run the same object.
"""

from __future__ import annotations

import hmac
import logging
from collections.abc import Awaitable, Callable

from aiohttp import web
from pydantic import ValidationError

from tierguard import __version__
from tierguard.common.errors import TierguardError
from tierguard.common.peers import EdgeCollector, PeerGuard, PeerLimits, expect_json
from tierguard.common.tokenpool import TokenizerPool
from tierguard.engine.api import AsyncEngine
from tierguard.gate import AdmissionController, AdmissionPolicy
from tierguard.gate.metrics import ControllerCollector
from tierguard.gate.tokens_fit import TokenBytes, token_bytes_of
from tierguard.serve import generate
from tierguard.serve.errors import APIError, bad_request, dead_header, from_validation_error
from tierguard.serve.generate import ServeState
from tierguard.serve.metrics import CONTENT_TYPE, ServeMetrics
from tierguard.serve.protocol import DetokenizeRequest, TokenizeRequest

log = logging.getLogger("tierguard.serve")

STATE_KEY: web.AppKey[ServeState] = web.AppKey("tierguard_serve_state", ServeState)

# Paths that need the API key when one is set; health, version and metrics stay open
# so probes and scrapers work without secrets (as in vLLM).
_PROTECTED_PREFIXES = ("/v1/", "/tokenize", "/detokenize")

# Body limit for a tokenizer without a byte rule (no `tokenizers` backend): a generous
# guess at the longest token in bytes, so the limit still follows max_model_len.
UNKNOWN_TOKEN_BYTES = 32

Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]


def create_app(
    engine: AsyncEngine,
    *,
    api_key: str | None = None,
    served_model_name: str | list[str] | None = None,
    manage_engine: bool = True,
    admission: AdmissionPolicy | None = None,
    limits: PeerLimits | None = None,
    max_body_bytes: int | None = None,
    tokenizer_workers: int = 2,
    tokenizer_queue: int = 32,
    prompt_tokens_details: bool = False,
) -> web.Application:
    """The server; with `admission`, every generating request passes the gate's controller.

    `limits` are the slow-peer deadlines (docs/hardening.md); run the app with
    `guarded_runner(app[STATE_KEY].guard, app)` for the header deadline to apply. The body limit
    defaults to what the longest prompt that fits could need (`tokens_fit.py`).
    """
    if isinstance(served_model_name, str):
        names = [served_model_name]
    else:
        names = list(served_model_name or [engine.model_name])
    metrics = ServeMetrics(engine, names[0])
    engine.add_step_listener(metrics.on_step)
    controller = None
    if admission is not None:
        if admission.validate().overflow == "async":
            raise TierguardError("overflow 'async' needs a job store: run `tierguard gate` in front of serve")
        controller = AdmissionController(admission)
        metrics.registry.register(ControllerCollector(controller))
    guard = PeerGuard(limits)
    token_bytes = token_bytes_of(engine.tokenizer)
    derived = (token_bytes or TokenBytes(UNKNOWN_TOKEN_BYTES, exact=False)).body_limit(engine.max_model_len)
    if max_body_bytes is None:
        max_body_bytes = derived
    elif max_body_bytes > derived and token_bytes is not None:
        log.warning("--max-body-bytes %d is above %d, the most a prompt that fits max_model_len %d can need: "
                    "bigger bodies are read and parsed on the event loop only to be refused", max_body_bytes,
                    derived, engine.max_model_len)
    pool = TokenizerPool(engine.tokenizer, workers=tokenizer_workers, max_pending=tokenizer_queue)
    state = ServeState(
        engine=engine, served_model_names=names, api_key=api_key or None, metrics=metrics, admission=controller,
        guard=guard, pool=pool, token_bytes=token_bytes, max_body_bytes=max_body_bytes,
        prompt_tokens_details=prompt_tokens_details,
    )
    metrics.registry.register(EdgeCollector("tierguard:", guard, pool, {"model_name": names[0]}))

    # guard first: it must see every request, refused ones included, to stop its header timer.
    app = web.Application(
        middlewares=[guard.middleware(), _errors_middleware, _auth_middleware], client_max_size=max_body_bytes + 1024
    )
    app[STATE_KEY] = state
    app.on_cleanup.append(_close_pool)
    post, get = _routes(app)
    post("/v1/completions", _with_state(generate.completions))
    post("/v1/chat/completions", _with_state(generate.chat_completions))
    get("/v1/models", models)
    get("/health", health)
    get("/version", version)
    post("/tokenize", tokenize)
    post("/detokenize", detokenize)
    get("/metrics", metrics_handler)
    if manage_engine:
        app.on_startup.append(_start_engine)
        app.on_cleanup.append(_stop_engine)
    return app


def _routes(app: web.Application):
    """add_post/add_get with a JSON 417 for an unknown `Expect:` (see peers.expect_json)."""

    def post(path: str, handler: Handler) -> None:
        app.router.add_post(path, handler, expect_handler=expect_json)

    def get(path: str, handler: Handler) -> None:
        app.router.add_get(path, handler, expect_handler=expect_json)

    return post, get


def _with_state(fn: Callable[[web.Request, ServeState], Awaitable[web.StreamResponse]]) -> Handler:
    async def handler(request: web.Request) -> web.StreamResponse:
        return await fn(request, request.app[STATE_KEY])

    return handler


async def _start_engine(app: web.Application) -> None:
    await app[STATE_KEY].engine.start()


async def _stop_engine(app: web.Application) -> None:
    await app[STATE_KEY].engine.shutdown()


async def _close_pool(app: web.Application) -> None:
    pool = app[STATE_KEY].pool
    if pool is not None:
        pool.close()


@web.middleware
async def _errors_middleware(request: web.Request, handler: Handler) -> web.StreamResponse:
    """Every failure leaves as an OpenAI error body; nothing leaks a traceback."""
    state = request.app[STATE_KEY]
    route = request.match_info.route.resource.canonical if request.match_info.route.resource else "unmatched"
    try:
        resp = await handler(request)
    except APIError as exc:
        resp = exc.response()
    except ValidationError as exc:
        resp = from_validation_error(exc).response()
    except web.HTTPException as exc:
        if exc.status < 400:
            raise
        msg = "no such route" if exc.status == 404 else exc.reason
        resp = APIError(exc.status, f"{request.method} {request.path}: {msg}").response()
    except Exception:
        log.exception("unhandled error in %s %s", request.method, request.path)
        resp = APIError(500, "internal server error; see the server log").response()
    if resp.status in (408, 413):
        resp.force_close()  # the rest of the body was not read: the connection cannot be reused
    state.metrics.on_response(route, resp.status)
    return resp


@web.middleware
async def _auth_middleware(request: web.Request, handler: Handler) -> web.StreamResponse:
    key = request.app[STATE_KEY].api_key
    if key is not None and request.path.startswith(_PROTECTED_PREFIXES):
        given = request.headers.get("Authorization", "")
        token = given[7:] if given[:7].lower() == "bearer " else ""
        # compare_digest: the time taken must not reveal how much of the key matched.
        if not hmac.compare_digest(token.encode(), key.encode()):
            raise APIError(401, "missing or invalid API key: send `Authorization: Bearer <key>`")
    return await handler(request)


async def models(request: web.Request) -> web.Response:
    state = request.app[STATE_KEY]
    created = int(state.started_at)
    data = [
        {
            "id": name,
            "object": "model",
            "created": created,
            "owned_by": "tierguard",
            "root": state.engine.model_name,
            "max_model_len": state.engine.max_model_len,
        }
        for name in state.served_model_names
    ]
    return web.json_response({"object": "list", "data": data})


async def health(request: web.Request) -> web.Response:
    """200 "ok" (or "degraded" with a broken cold tier) while the engine serves; 503 "dead",
    naming the error, once it has stopped: a gate or an orchestrator takes it out then."""
    engine = request.app[STATE_KEY].engine
    why = engine.failure()
    if why is not None:
        return web.json_response({"status": "dead", "error": why}, status=503, headers=dead_header())
    s = engine.stats()
    body = {
        "status": "ok",
        "num_running": s.num_running,
        "num_waiting": s.num_waiting,
        "kv_cache_usage": s.kv_usage,
    }
    # A broken disk tier degrades the server but does not stop it: still 200 and serving.
    tiers = engine.tier_health() if hasattr(engine, "tier_health") else None
    if tiers is not None:
        body["kv_tiers"] = tiers
        if not tiers["healthy"]:
            body["status"] = "degraded"
    return web.json_response(body)


async def version(request: web.Request) -> web.Response:
    return web.json_response({"version": __version__})


async def tokenize(request: web.Request) -> web.Response:
    state = request.app[STATE_KEY]
    req = TokenizeRequest.model_validate_json(await state.read_body(request))
    state.check_model(req.model)
    if (req.prompt is None) == (req.messages is None):
        raise bad_request("send exactly one of `prompt` or `messages`", "prompt")
    if req.messages is not None:
        msgs = [{"role": m.role, "content": m.text()} for m in req.messages]
        ids = await state.encode_chat(msgs, req.add_generation_prompt)
    else:
        ids = await state.encode(req.prompt or "", add_special_tokens=req.add_special_tokens)
    return web.json_response({"count": len(ids), "max_model_len": state.engine.max_model_len, "tokens": ids})


async def detokenize(request: web.Request) -> web.Response:
    state = request.app[STATE_KEY]
    req = DetokenizeRequest.model_validate_json(await state.read_body(request))
    state.check_model(req.model)
    vocab = getattr(state.engine.tokenizer, "vocab_size", None)
    bad = [t for t in req.tokens if t < 0 or (vocab is not None and t >= vocab)]
    if bad:
        raise bad_request(f"token ids {bad[:5]} are outside the vocabulary (0..{vocab})", "tokens")
    text = await state.decode(req.tokens)  # off the event loop, as encoding is
    return web.json_response({"prompt": text})


async def metrics_handler(request: web.Request) -> web.Response:
    body = request.app[STATE_KEY].metrics.render()
    return web.Response(body=body, headers={"Content-Type": CONTENT_TYPE})
