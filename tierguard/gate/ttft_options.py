"""The options of predicted admission (`--admission predicted`), validated at the edge.

    --ttft-slo-ms interactive=1000,batch=20000    per-class TTFT SLO (these are the defaults)
    --ttft-calibration FILE                        a `tierguard predict` calibration, every upstream
    --ttft-calibration 1=FILE | URL=FILE           ... or one upstream's (its index or its URL)
    --ttft-chunk-tokens N                          the engine's tokens per step, when no file says
    --ttft-online on|off                           keep learning from responses (default on)

Everything is checked when the gate starts: a missing or malformed calibration file, an
unknown class or a non-positive SLO stops it with a message naming the option.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from tierguard.common.errors import TierguardError
from tierguard.gate.ttft_model import Prior, load_calibration

ADMISSIONS = ("static", "predicted")
DEFAULT_SLO_MS = {"interactive": 1000.0, "batch": 20000.0}


@dataclass
class PredictedOptions:
    slo_s: dict[str, float]  # class -> TTFT SLO in seconds
    priors: list[Prior]  # one per upstream, in --upstream order
    online: bool = True
    window: int = 100  # observations the fit remembers (forgetting factor 1 - 1/window)


def parse_slo_ms(value: object) -> dict[str, float]:
    """"interactive=1000,batch=20000" (or a {class: ms} table) -> {class: ms}; classes left
    out keep their defaults."""
    out = dict(DEFAULT_SLO_MS)
    if value is None or value == "":
        return out
    if isinstance(value, dict):
        items = [(str(k), v) for k, v in value.items()]
    else:
        items = []
        for part in str(value).split(","):
            if not part.strip():
                continue
            name, sep, ms = part.partition("=")
            if not sep:
                raise TierguardError(f"--ttft-slo-ms item {part.strip()!r}: expected CLASS=MS, e.g. interactive=1000")
            items.append((name.strip(), ms.strip().removesuffix("ms")))
    for name, ms in items:
        if name not in DEFAULT_SLO_MS:
            raise TierguardError(f"--ttft-slo-ms: unknown class {name!r} (use interactive and batch)")
        try:
            number = float(ms)  # type: ignore[arg-type]
        except (TypeError, ValueError):
            raise TierguardError(f"--ttft-slo-ms {name}={ms!r}: not a number of milliseconds") from None
        if isinstance(ms, bool) or not (math.isfinite(number) and number > 0):
            raise TierguardError(f"--ttft-slo-ms {name}={ms!r}: must be a positive number of milliseconds")
        out[name] = number
    return out


def parse_switch(value: object, name: str) -> bool:
    if isinstance(value, bool):
        return value
    text = str(value).strip().lower()
    if text in ("on", "true", "yes", "1"):
        return True
    if text in ("off", "false", "no", "0"):
        return False
    raise TierguardError(f"{name} must be on or off, got {value!r}")


def calibration_files(specs: list[str] | str | None, urls: list[str]) -> list[str | None]:
    """Which calibration file each upstream takes: `N=FILE` or `URL=FILE` for one, a bare
    `FILE` for every upstream without its own."""
    if isinstance(specs, str):
        specs = [specs]
    out: list[str | None] = [None] * len(urls)
    default: str | None = None
    for spec in specs or []:
        head, sep, tail = str(spec).partition("=")
        if sep and head.isdigit():
            index = int(head)
            if index >= len(urls):
                raise TierguardError(f"--ttft-calibration {spec!r}: there is no upstream {index} "
                                     f"(upstreams are numbered 0..{len(urls) - 1} in --upstream order)")
            out[index] = tail
        elif sep and head.startswith(("http://", "https://")):
            url = head.rstrip("/").removesuffix("/v1")
            if url not in urls:
                raise TierguardError(f"--ttft-calibration {spec!r}: {head} is not one of the --upstream URLs")
            out[urls.index(url)] = tail
        else:
            default = str(spec)
    return [f if f is not None else default for f in out]


def options_from(settings) -> PredictedOptions:
    """PredictedOptions from GateSettings (its ttft_* fields); raises TierguardError."""
    chunk = settings.ttft_chunk_tokens
    if chunk is not None and (isinstance(chunk, bool) or not isinstance(chunk, int) or chunk <= 0):
        raise TierguardError(f"--ttft-chunk-tokens must be a positive whole number, got {chunk!r}")
    window = settings.ttft_window
    if isinstance(window, bool) or not isinstance(window, int) or window < 10:
        raise TierguardError(f"ttft_window must be a whole number >= 10, got {window!r}")
    files = calibration_files(settings.ttft_calibration, settings.upstreams)
    loaded: dict[str, Prior] = {}
    priors = []
    for f in files:
        if f is None:
            priors.append(Prior.empty(chunk))
            continue
        if f not in loaded:
            loaded[f] = load_calibration(f, chunk)
        priors.append(loaded[f])
    slo_s = {k: ms / 1000.0 for k, ms in parse_slo_ms(settings.ttft_slo_ms).items()}
    return PredictedOptions(slo_s, priors,
                            parse_switch(settings.ttft_online, "--ttft-online"), window)
