"""Request tracing with OpenTelemetry: one trace per request, across every process it touches.

Off by default. With ``tracing.otlp_endpoint`` in the config, each replica process exports its spans over
OTLP/gRPC to that collector (batched, off the request path). Off, the request path makes no span and no
context: each call below returns at its first check.

One request's trace (the process that records each span on the right)::

    shapeserve.request               arrival at the edge to the end of the response   edge (decode replica)
      shapeserve.admission           plan, classify, admit                             edge
      shapeserve.queue               waiting for a step (LOCAL) or for KV blocks       decode
      shapeserve.prefill             LOCAL: the prompt in the decode engine            decode
      shapeserve.remote_prefill      one attempt on a prefill replica (REMOTE)         decode
        shapeserve.queue             waiting in the prefill engine                     prefill
        shapeserve.prefill           the prompt in the prefill engine                  prefill
        shapeserve.kv_transfer       the prompt's KV pushed into the decode replica    prefill
      shapeserve.decode              first token to the last                           decode

The context crosses processes as W3C trace-context headers inside the typed messages
(``GenerateTask.trace_context``, ``PrefillTask.trace_context``): a process never starts a trace of its own,
it only continues the edge's, so the edge's sampling decision holds everywhere.

Span times are wall-clock nanoseconds. Spans whose bounds are only known afterwards (the engine's queue time
arrives with a request's first output) are recorded with explicit start and end times.
"""

from __future__ import annotations

import os
import time
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

from opentelemetry import trace
from opentelemetry.trace import Span, SpanKind, Status, StatusCode
from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator

if TYPE_CHECKING:
    from opentelemetry.sdk.trace import TracerProvider

    from cluster.serving.config import TracingConfig

#: W3C trace-context headers (``traceparent``, ``tracestate``) as a message carries them; () = not traced.
TraceContext = tuple[tuple[str, str], ...]

#: Span attributes (OpenTelemetry's values: str, bool, int, float, or sequences of them).
Attributes = Mapping[str, Any]

_PROPAGATOR = TraceContextTextMapPropagator()
#: This process's tracer; None while tracing is off.
_tracer: trace.Tracer | None = None


def configure(config: TracingConfig, role: str) -> None:
    """Turns this process's tracing on from the config (each replica calls it as it starts; a process already
    tracing keeps its exporter). Nothing happens without an ``otlp_endpoint``."""
    if config.otlp_endpoint is None or _tracer is not None:
        return
    from opentelemetry.exporter.otlp.proto.grpc.trace_exporter import OTLPSpanExporter
    from opentelemetry.sdk.resources import Resource
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.export import BatchSpanProcessor
    from opentelemetry.sdk.trace.sampling import ParentBased, TraceIdRatioBased

    provider = TracerProvider(
        resource=Resource.create(
            {"service.name": config.service_name, "shapeserve.role": role, "process.pid": os.getpid()}
        ),
        sampler=ParentBased(TraceIdRatioBased(config.sample_ratio)),
    )
    endpoint = config.otlp_endpoint
    provider.add_span_processor(
        BatchSpanProcessor(OTLPSpanExporter(endpoint=endpoint, insecure=endpoint.startswith("http://")))
    )
    use_provider(provider)


def use_provider(provider: TracerProvider | None) -> None:
    """Traces this process's requests through ``provider`` (None: off). Tests pass one with an in-memory
    exporter."""
    global _tracer
    _tracer = provider.get_tracer("shapeserve") if provider is not None else None


def enabled() -> bool:
    return _tracer is not None


def context_of(span: Span | None) -> TraceContext:
    """What a message carries so that the receiving process's spans are children of ``span``."""
    if span is None or not span.is_recording():
        return ()
    carrier: dict[str, str] = {}
    _PROPAGATOR.inject(carrier, context=trace.set_span_in_context(span))
    return tuple(sorted(carrier.items()))


def start_child(
    name: str, parent: TraceContext, start_ns: int | None = None, attributes: Attributes | None = None
) -> Span | None:
    """A span under the context a message carried; None when tracing is off here or the request is not
    traced. End it with ``end``."""
    if _tracer is None or not parent:
        return None
    context = _PROPAGATOR.extract(dict(parent))
    return _tracer.start_span(name, context=context, start_time=start_ns, attributes=attributes)


def record(
    name: str,
    parent: TraceContext,
    start_ns: int,
    end_ns: int,
    attributes: Attributes | None = None,
    error: str | None = None,
) -> None:
    """A finished span whose bounds are known (a no-op when not traced)."""
    span = start_child(name, parent, start_ns, attributes)
    end(span, end_ns, error)


def end(span: Span | None, end_ns: int | None = None, error: str | None = None, attributes: Attributes | None = None):
    if span is None:
        return
    if attributes:
        span.set_attributes(attributes)
    if error is not None:
        span.set_status(Status(StatusCode.ERROR, error))
    span.end(end_time=end_ns)


class RequestTrace:
    """The edge's part of one HTTP request's trace: the root span, from ``received_ns`` until the request's
    last engine request (``run_started`` / ``run_ended``) has ended, and its ``shapeserve.admission`` child.
    ``context`` goes into each ``GenerateTask``. Everything is a no-op when tracing is off."""

    def __init__(self, name: str, received_ns: int, attributes: Attributes):
        self.root: Span | None = None
        if _tracer is not None:
            self.root = _tracer.start_span(
                "shapeserve.request", kind=SpanKind.SERVER, start_time=received_ns, attributes=attributes
            )
            self.root.update_name(f"shapeserve.request {name}")
        self.context = context_of(self.root)
        self._open_runs = 0
        self._routes: set[str] = set()
        self._output_tokens = 0

    def admission(self, start_ns: int, attributes: Attributes | None = None, error: str | None = None) -> None:
        record("shapeserve.admission", self.context, start_ns, time.time_ns(), attributes, error)

    def run_started(self) -> None:
        self._open_runs += 1

    def run_ended(self, outcome: str, route: str, output_tokens: int) -> None:
        """One engine request of this HTTP request ended (``outcome``: ok, aborted, cancelled, error; its route
        and output tokens go on the root, summed over the request's choices); the root ends with the last."""
        self._open_runs -= 1
        self._routes.add(route)
        self._output_tokens += output_tokens
        if self._open_runs <= 0 and self.root is not None:
            self.root.set_attributes(
                {
                    "shapeserve.route": ",".join(sorted(self._routes)),
                    "shapeserve.output_tokens": self._output_tokens,
                }
            )
            self.end(None if outcome in ("ok", "aborted") else outcome)

    def end(self, error: str | None = None) -> None:
        """Ends the root (idempotent): at the last run's end, or at an error before any run started."""
        root, self.root = self.root, None
        end(root, error=error)
