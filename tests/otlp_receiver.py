"""A real OTLP/HTTP trace receiver for tests: decodes ExportTraceServiceRequest protobufs (opentelemetry-proto)."""

from __future__ import annotations

import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import (
    ExportTraceServiceRequest,
    ExportTraceServiceResponse,
)


class OtlpReceiver:
    """Listens on 127.0.0.1:<port>/v1/traces; ``spans`` holds dicts with service, ids, name, kind, attrs, events."""

    def __init__(self) -> None:
        self.spans: list[dict[str, Any]] = []
        self.lock = threading.Lock()
        receiver = self

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self) -> None:
                body = self.rfile.read(int(self.headers.get("content-length", "0")))
                req = ExportTraceServiceRequest()
                req.ParseFromString(body)
                receiver._add(req)
                out = ExportTraceServiceResponse().SerializeToString()
                self.send_response(200)
                self.send_header("content-type", "application/x-protobuf")
                self.send_header("content-length", str(len(out)))
                self.end_headers()
                self.wfile.write(out)

            def log_message(self, *args: Any) -> None:
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.port = self.server.server_address[1]
        self.endpoint = f"http://127.0.0.1:{self.port}"
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)
        self.thread.start()

    def _add(self, req: ExportTraceServiceRequest) -> None:
        for rs in req.resource_spans:
            service = next((a.value.string_value for a in rs.resource.attributes if a.key == "service.name"), "")
            for ss in rs.scope_spans:
                for s in ss.spans:
                    with self.lock:
                        self.spans.append({
                            "service": service, "trace_id": s.trace_id.hex(), "span_id": s.span_id.hex(),
                            "parent_id": s.parent_span_id.hex(), "name": s.name, "kind": s.kind,
                            "attrs": {a.key: _value(a.value) for a in s.attributes},
                            "events": [(e.name, {a.key: _value(a.value) for a in e.attributes}) for e in s.events],
                        })

    def wait_for(self, pred: Any, timeout: float = 15.0) -> list[dict[str, Any]]:
        """Spans once ``pred(spans)`` is true (AssertionError after ``timeout`` seconds)."""
        t0 = time.monotonic()
        while time.monotonic() - t0 < timeout:
            with self.lock:
                spans = list(self.spans)
            if pred(spans):
                return spans
            time.sleep(0.05)
        raise AssertionError(f"spans never matched; got {[(s['service'], s['name']) for s in self.spans]}")

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()


def _value(v: Any) -> Any:
    kind = v.WhichOneof("value")
    return getattr(v, kind) if kind else None
