"""Prometheus metrics of the gate: queue depth and in-flight per class, decisions by
reason, queue wait, and TTFT/ITL/E2E as seen through the gate (R13: watch queue depth).

Each gate owns its registry (tests run several gates in one process). Queue depth,
in-flight and decision counts are read from the controller at scrape time, so the
request path never pays for them.
"""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily
from prometheus_client.metrics import MetricWrapperBase

from tierguard.common.histogram import LatencyHistogram
from tierguard.common.peers import EdgeCollector
from tierguard.common.redact import redact_url
from tierguard.gate.admission import AdmissionController

_LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)
_ITL_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.02, 0.05, 0.1, 0.25, 0.5, 1.0, 5.0)


class ControllerCollector:
    """Reads queue depth, in-flight and decisions from a controller at scrape time."""

    def __init__(self, controller: AdmissionController) -> None:
        self.controller = controller  # or a SharedAdmission: the same stats()

    def collect(self):
        s = self.controller.stats()
        q = GaugeMetricFamily("tierguard_gate_queue_depth", "Requests waiting for a slot", labels=["class"])
        f = GaugeMetricFamily("tierguard_gate_in_flight", "Requests holding a slot", labels=["class"])
        for klass, n in s.queued.items():
            q.add_metric([klass], n)
        for klass, n in s.in_flight.items():
            f.add_metric([klass], n)
        d = CounterMetricFamily("tierguard_gate_decisions", "Admission decisions", labels=["decision", "reason"])
        for (decision, reason), n in sorted(s.decisions.items()):
            d.add_metric([decision, reason], n)
        return [q, f, d]


class _JobsCollector:
    def __init__(self, jobs, runner=None) -> None:
        self.jobs = jobs
        self.runner = runner

    def collect(self):
        j = self.jobs
        out = []
        for name, doc, value in (
            ("jobs_expired", "Finished async jobs deleted after --job-ttl-s", j.expired),
            ("jobs_undecryptable", "Async job reads refused: no configured key opens the file", j.undecryptable),
            ("jobs_disk_full", "Async job writes that failed with a full disk (ENOSPC, EDQUOT): a new job "
                               "gets 507, a running one is failed", j.disk_full),
            ("jobs_write_errors", "Async job writes that failed for another reason", j.write_errors),
            ("jobs_failed_internal", "Async jobs failed by an exception (their worker went on)",
             self.runner.failed_internal if self.runner is not None else 0),
        ):
            m = CounterMetricFamily("tierguard_gate_" + name, doc)
            m.add_metric([], value)
            out.append(m)
        refused = CounterMetricFamily("tierguard_gate_jobs_refused", "New async jobs refused by a quota, by "
                                      "reason (queue_full, quota_key_pending, quota_key_bytes, quota_total_bytes, "
                                      "job_too_large)", labels=["reason"])
        for reason, n in sorted(dict(j.refused).items()):
            refused.add_metric([reason], n)
        pending, nbytes = j.ledger.totals()
        p = GaugeMetricFamily("tierguard_gate_jobs_pending", "Async jobs queued or running")
        p.add_metric([], pending)
        b = GaugeMetricFamily("tierguard_gate_jobs_bytes", "Bytes of async job files on disk")
        b.add_metric([], nbytes)
        return [*out, refused, p, b]


class FleetCollector:
    """Per-upstream in-flight, queue depth, health and ejections; routed requests by reason;
    and, under --shared-state, the shared slots' waits, lease expiries and fallbacks."""

    def __init__(self, fleet, shared) -> None:
        self.fleet = fleet
        self.shared = shared

    def collect(self):
        labels = ["upstream"]
        fams = {
            "in_flight": GaugeMetricFamily("tierguard_gate_upstream_in_flight",
                                           "This gate's requests running on each upstream", labels=labels),
            "queued": GaugeMetricFamily("tierguard_gate_upstream_queued",
                                        "Queue depth each upstream last reported on its /metrics", labels=labels),
            "healthy": GaugeMetricFamily("tierguard_gate_upstream_healthy",
                                         "1 while the upstream takes traffic, 0 while ejected", labels=labels),
            "ejections": CounterMetricFamily("tierguard_gate_upstream_ejections",
                                             "Times the upstream was ejected (failed probe or requests)",
                                             labels=labels),
        }
        for r in self.fleet.replicas:
            label = [redact_url(r.url)]
            fams["in_flight"].add_metric(label, r.in_flight)
            fams["queued"].add_metric(label, r.queued)
            fams["healthy"].add_metric(label, int(r.healthy))
            fams["ejections"].add_metric(label, r.ejections)
        routed = CounterMetricFamily("tierguard_gate_routed", "Routing choices by upstream and reason "
                                     "(prefix_hit, load, sticky, round_robin, failover)",
                                     labels=["upstream", "reason"])
        for (index, reason), n in sorted(self.fleet.routed.items()):
            routed.add_metric([redact_url(self.fleet.replicas[index].url), reason], n)
        out = [*fams.values(), routed]
        index = getattr(self.fleet.router, "index", None)
        if index is not None:
            g = GaugeMetricFamily("tierguard_gate_prefix_index_entries", "Prefix chunks the router remembers")
            g.add_metric([], len(index))
            out.append(g)
        if self.shared is not None:
            c = self.shared.counters
            for name, doc, value in (
                ("shared_slot_waits", "Requests that waited in the fleet-wide queue for a shared slot", c.waits),
                ("shared_lease_expiries", "Expired leases this gate reaped: their gate stopped renewing "
                                          "(killed or stalled) and the slot came back", c.lease_expiries),
                ("shared_leases_readded", "This gate's leases found gone at renewal and written back "
                                          "(a stall past the lease, or admitted while Redis was down)", c.readded),
                ("shared_fallback_admissions", "Requests admitted by the local share while Redis was "
                                               "unreachable", c.fallback_admissions),
                ("shared_errors", "Redis calls that failed or timed out", c.errors),
            ):
                m = CounterMetricFamily("tierguard_gate_" + name, doc)
                m.add_metric([], value)
                out.append(m)
            up = GaugeMetricFamily("tierguard_gate_shared_state_up",
                                   "1: limits are fleet-wide (Redis answers); 0: the local share applies")
            up.add_metric([], int(self.shared.up))
            gates = GaugeMetricFamily("tierguard_gate_shared_live_gates", "Gates last seen alive in Redis")
            gates.add_metric([], c.live_gates)
            out += [up, gates]
        return out


class ChunkHistogram:
    """A histogram for the per-chunk path (ITL): `observe` is one bisect and two adds.

    prometheus_client's Histogram takes a lock and walks every bucket per observation;
    on a path run thousands of times a second that is measurable. Single event loop,
    so no lock is needed: the counting is the engine's plain `LatencyHistogram`,
    exported as a standard histogram at scrape time.
    """

    def __init__(self, name: str, documentation: str, buckets: tuple[float, ...]) -> None:
        self.name, self.documentation = name, documentation
        self.hist = LatencyHistogram(tuple(buckets))
        self.observe = self.hist.observe  # the bound method itself: no wrapper call per chunk

    def collect(self):
        h = HistogramMetricFamily(self.name, self.documentation)
        h.add_metric([], self.hist.cumulative(), self.hist.total_s)
        return [h]


class GateMetrics:
    def __init__(self, controller: AdmissionController) -> None:
        self.registry = CollectorRegistry()
        self._children: dict[tuple[int, str], MetricWrapperBase] = {}
        self.registry.register(ControllerCollector(controller))
        r = self.registry
        self.queue_wait = Histogram("tierguard_gate_queue_wait_seconds", "Time a request waited for a slot",
                                    ["class"], buckets=_LATENCY_BUCKETS, registry=r)
        self.ttft = Histogram("tierguard_gate_ttft_seconds", "Arrival at the gate to first byte of output",
                              ["class"], buckets=_LATENCY_BUCKETS, registry=r)
        self.itl = ChunkHistogram("tierguard_gate_itl_seconds", "Gap between streamed chunks through the gate",
                                  _ITL_BUCKETS)
        r.register(self.itl)
        self.e2e = Histogram("tierguard_gate_e2e_seconds", "Arrival at the gate to end of response",
                             ["class"], buckets=_LATENCY_BUCKETS, registry=r)
        self.responses = Counter("tierguard_gate_responses", "Responses by HTTP status", ["status"], registry=r)
        self.token_counts = Counter("tierguard_gate_token_counts", "Admission token counts by method "
                                    "(exact, estimate, byte_bound = skipped: surely short)", ["method"], registry=r)
        self.upstream_errors = Counter("tierguard_gate_upstream_errors", "Upstream failures by kind",
                                       ["kind"], registry=r)

    def add_edge(self, guard, pool, jobs, runner=None) -> None:
        """Slow peers, body limits, the byte rule and the tokenizer pool (`common/peers.py`),
        plus async jobs: housekeeping (expired results, files no key opens), quota refusals,
        write failures (a full disk) and jobs failed by an exception."""
        self.registry.register(EdgeCollector("tierguard_gate_", guard, pool))
        self.registry.register(_JobsCollector(jobs, runner))

    def add_fleet(self, fleet, shared) -> None:
        """The upstreams (`upstreams.Fleet`) and, with --shared-state, the shared slots."""
        self.registry.register(FleetCollector(fleet, shared))

    def add_prediction(self, controller) -> None:
        """Predicted admission's errors, coefficients, work and bookings (`PredictionCollector`)."""
        self.registry.register(PredictionCollector(controller))

    def child(self, metric: MetricWrapperBase, label: str) -> MetricWrapperBase:
        """The labelled child of `metric`, from a plain dict (prometheus' .labels() takes a lock
        and builds a key tuple on every call; the request path calls this five times)."""
        key = (id(metric), label)
        found = self._children.get(key)
        if found is None:
            found = self._children[key] = metric.labels(label)
        return found

    def render(self) -> bytes:
        return generate_latest(self.registry)


class PredictionCollector:
    """Predicted admission (`ttft_admission.py`), per upstream: how far its predictions are
    off (predicted - measured TTFT: at admission, from the arrival; at dispatch, from the
    send), the fit's current coefficients with their standard errors and relative spread,
    the work it sees, and the bookings kept for rejected clients' retries."""

    def __init__(self, controller) -> None:
        self.controller = controller

    def collect(self):
        from tierguard.gate.ttft_model import TERMS

        c = self.controller
        err = HistogramMetricFamily("tierguard_gate_ttft_prediction_error_seconds",
                                    "Predicted minus measured TTFT (negative: the prediction was short; "
                                    "buckets only, as the format has no sum for negative buckets)",
                                    labels=["upstream", "stage"])
        abs_err = HistogramMetricFamily("tierguard_gate_ttft_prediction_abs_error_seconds",
                                        "|predicted - measured| TTFT", labels=["upstream", "stage"])
        coef = GaugeMetricFamily("tierguard_gate_ttft_model_coefficient",
                                 "The closed form's coefficients in seconds per unit (base, per_token, per_key, "
                                 "per_step, per_decode)", labels=["upstream", "term"])
        coef_sd = GaugeMetricFamily("tierguard_gate_ttft_model_coefficient_stddev",
                                    "Standard error of each coefficient", labels=["upstream", "term"])
        spread = GaugeMetricFamily("tierguard_gate_ttft_model_relative_error",
                                   "Spread (rms) of (measured - predicted) / predicted over recent answers",
                                   labels=["upstream"])
        bias = GaugeMetricFamily("tierguard_gate_ttft_model_relative_bias",
                                 "Mean of (measured - predicted) / predicted over recent answers", labels=["upstream"])
        seen = CounterMetricFamily("tierguard_gate_ttft_model_observations", "Answers the fit has seen",
                                   labels=["upstream", "source"])
        work = GaugeMetricFamily("tierguard_gate_ttft_work_tokens",
                                 "Prompt tokens: sent and not yet prefilled, waiting in this gate, reported by "
                                 "other gates", labels=["upstream", "where"])
        decodes = GaugeMetricFamily("tierguard_gate_ttft_decodes", "Requests decoding there (this gate and others)",
                                    labels=["upstream"])
        now = c.clock()
        for u in c.upstreams:
            for stage, hist in u.errors.items():
                err.add_metric([u.url, stage], hist.cumulative(), hist.total_s)
                a = u.abs_errors[stage]
                abs_err.add_metric([u.url, stage], a.cumulative(), a.total_s)
            for term, value, sd in zip(TERMS, u.fit.coef, u.fit.coef_sd(), strict=True):
                coef.add_metric([u.url, term], value)
                coef_sd.add_metric([u.url, term], sd)
            spread.add_metric([u.url], u.fit.rel_sd)
            bias.add_metric([u.url], u.fit.rel_bias)
            seen.add_metric([u.url, u.fit.prior.source], u.fit.observations)
            work.add_metric([u.url, "sent"], u.prefill_left(now)[0])
            work.add_metric([u.url, "waiting"], u.queued()[0])
            work.add_metric([u.url, "other_gates"], u.others.tokens)
            decodes.add_metric([u.url], u.decodes())
        b = c.bookings
        booked = GaugeMetricFamily("tierguard_gate_ttft_bookings", "Places kept for rejected clients' retries")
        booked.add_metric([], len(b))
        outcomes = CounterMetricFamily("tierguard_gate_ttft_booking_outcomes", "Bookings made, claimed by the "
                                       "retry, expired unclaimed", labels=["outcome"])
        for name, n in (("made", b.made), ("claimed", b.claimed), ("expired", b.expired)):
            outcomes.add_metric([name], n)
        share = GaugeMetricFamily("tierguard_gate_ttft_booking_show_share",
                                  "Share of booked clients that came back (bookings count by it)")
        share.add_metric([], b.show_share)
        out = [err, abs_err, coef, coef_sd, spread, bias, seen, work, decodes, booked, outcomes, share]
        if c.shared is not None:
            up = GaugeMetricFamily("tierguard_gate_ttft_shared_up", "1: other gates' work is read from Redis")
            up.add_metric([], int(c.shared.up))
            errs = CounterMetricFamily("tierguard_gate_ttft_shared_errors", "Failed exchanges of the shared work")
            errs.add_metric([], c.shared.errors)
            out += [up, errs]
        return out
