"""The decode replica's spans of one request (``cluster.serving.tracing``): its wait (for KV blocks, or for
a step of the engine), the prompt's prefill when this engine computed it, and its decode. A no-op for an
untraced request (no context in its ``GenerateTask``).

The engine's queue time arrives with the request's first output (``RequestOutput.first_scheduled_at``),
so these spans are recorded with explicit bounds once they are known.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from typing import TYPE_CHECKING

from cluster.serving import tracing

if TYPE_CHECKING:
    from cluster.engine.llm_engine import RequestOutput


class RequestSpans:
    def __init__(self, context: tracing.TraceContext):
        self.context = context
        self.arrived_ns = time.time_ns() if context else 0
        self.first_ns: int | None = None
        self.last: RequestOutput | None = None

    def waited_for_blocks(self) -> None:
        """A REMOTE request got its KV blocks reserved (the wait for them ends now)."""
        if self.context:
            attributes = {"shapeserve.waited_for": "kv_blocks"}
            tracing.record("shapeserve.queue", self.context, self.arrived_ns, time.time_ns(), attributes)

    def outputs(self, batch: Sequence[RequestOutput]) -> None:
        if not self.context:
            return
        if self.first_ns is None:
            self.first_ns = now = time.time_ns()
            first = batch[0]
            if first.first_scheduled_at is not None:  # this engine computed the prompt (LOCAL, or a fallback)
                scheduled = int(first.first_scheduled_at * 1e9)
                waited = {"shapeserve.waited_for": "engine_step"}
                tracing.record("shapeserve.queue", self.context, self.arrived_ns, scheduled, waited)
                prompt = {
                    "shapeserve.prompt_tokens": first.num_prompt_tokens,
                    "shapeserve.cached_tokens": first.num_cached_tokens,
                }
                tracing.record("shapeserve.prefill", self.context, scheduled, now, prompt)
        self.last = batch[-1]

    def end(self) -> None:
        """The request ended (finished, failed, cancelled): its decode span, from its first token."""
        if not self.context or self.first_ns is None or self.last is None:
            return
        last = self.last
        error = last.error or (None if last.finished else "ended before it finished (cancelled or past its deadline)")
        attributes = {
            "shapeserve.output_tokens": last.num_output_tokens,
            "shapeserve.finish_reason": str(last.finish_reason),
        }
        tracing.record("shapeserve.decode", self.context, self.first_ns, time.time_ns(), attributes, error)
