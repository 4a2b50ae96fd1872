"""A minimal OTLP/gRPC trace collector for tests: keeps every span the server's processes export, with the
resource (process) that sent it. ``collector = OTLPCollector().start()``; ``collector.endpoint``; ``.spans()``."""

from __future__ import annotations

import threading
from concurrent import futures
from dataclasses import dataclass

import grpc
from opentelemetry.proto.collector.trace.v1 import trace_service_pb2, trace_service_pb2_grpc


@dataclass(frozen=True)
class ReceivedSpan:
    name: str
    trace_id: str
    span_id: str
    parent_span_id: str
    start_ns: int
    end_ns: int
    attributes: dict
    #: The exporting process's resource attributes (``shapeserve.role``, ``process.pid``).
    resource: dict
    status_code: int


def _value(v):
    kind = v.WhichOneof("value")
    return getattr(v, kind) if kind else None


class OTLPCollector(trace_service_pb2_grpc.TraceServiceServicer):
    def __init__(self):
        self._spans: list[ReceivedSpan] = []
        self._lock = threading.Lock()
        self._server = grpc.server(futures.ThreadPoolExecutor(max_workers=4))
        trace_service_pb2_grpc.add_TraceServiceServicer_to_server(self, self._server)
        self.port = self._server.add_insecure_port("127.0.0.1:0")
        self.endpoint = f"http://127.0.0.1:{self.port}"

    def start(self) -> OTLPCollector:
        self._server.start()
        return self

    def stop(self) -> None:
        self._server.stop(grace=None)

    def Export(self, request, context):  # noqa: N802 - the gRPC method's name
        received = []
        for rs in request.resource_spans:
            resource = {a.key: _value(a.value) for a in rs.resource.attributes}
            for ss in rs.scope_spans:
                for s in ss.spans:
                    received.append(
                        ReceivedSpan(
                            name=s.name,
                            trace_id=s.trace_id.hex(),
                            span_id=s.span_id.hex(),
                            parent_span_id=s.parent_span_id.hex(),
                            start_ns=s.start_time_unix_nano,
                            end_ns=s.end_time_unix_nano,
                            attributes={a.key: _value(a.value) for a in s.attributes},
                            resource=resource,
                            status_code=s.status.code,
                        )
                    )
        with self._lock:
            self._spans.extend(received)
        return trace_service_pb2.ExportTraceServiceResponse()

    def spans(self) -> list[ReceivedSpan]:
        with self._lock:
            return list(self._spans)
