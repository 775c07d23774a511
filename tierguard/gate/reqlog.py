"""The JSONL request log (R11): one line per request, as the gate saw it.

Fields: time, route, model, class, input/output tokens, queue wait, decision and
reason, status, TTFT and E2E, and which upstream answered and why it was chosen. Prompt text is absent unless `log_prompts` is on; keys
and headers are never written (the record is built from explicit fields only).
"""

from __future__ import annotations

import json
import logging
import time
from dataclasses import asdict, dataclass
from typing import TextIO

log = logging.getLogger("tierguard.gate")


@dataclass
class RequestRecord:
    route: str
    model: str | None = None
    klass: str | None = None
    input_tokens: int | None = None
    # how input_tokens was found: exact | estimate | byte_bound (not counted, surely short;
    # the figure is an estimate) | upstream_usage (byte_bound, then the upstream's prompt_tokens)
    token_count: str | None = None
    output_tokens: int | None = None
    queue_wait_ms: float | None = None
    decision: str = "admit"
    reason: str = ""
    status: int = 0
    ttft_ms: float | None = None
    e2e_ms: float | None = None
    stream: bool = False
    downgraded_from: int | None = None  # input tokens before a context downgrade
    job_id: str | None = None
    upstream: int | None = None  # index of the --upstream that answered (the last one tried)
    routed: str | None = None  # why it went there: prefix_hit, load, sticky, round_robin, failover
    prompt: str | None = None  # only with log_prompts


class RequestLog:
    """Appends records to a file (line-buffered) and mirrors refusals to the logger."""

    def __init__(self, path: str | None, log_prompts: bool = False) -> None:
        self._file: TextIO | None = open(path, "a", buffering=1, encoding="utf-8") if path else None  # noqa: SIM115
        self.log_prompts = log_prompts
        self.write_errors = 0  # records lost to a failed write (a full disk)

    def write(self, record: RequestRecord) -> None:
        if record.decision != "admit" or record.status >= 400:
            log.info("%s %s class=%s decision=%s reason=%s status=%s", record.route, record.model,
                     record.klass, record.decision, record.reason, record.status)
        if self._file is None:
            return
        data = asdict(record)
        data["class"] = data.pop("klass")
        if not self.log_prompts:
            data.pop("prompt")
        data = {"time": round(time.time(), 3), **data}
        try:
            self._file.write(json.dumps(data, separators=(",", ":")) + "\n")
        except OSError as exc:  # a full disk loses log lines, never the request being logged
            self.write_errors += 1
            if self.write_errors == 1:
                log.warning("request log: cannot write (%s); records are dropped until it can", exc.strerror or exc)

    def close(self) -> None:
        if self._file is not None:
            self._file.close()
            self._file = None
