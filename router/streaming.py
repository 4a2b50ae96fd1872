"""Server-sent events for one streaming request, encoded cheaply: one event per engine step.

The envelope of every chunk of a request (id, object, created, model, index) is the same, so it
is encoded once; each step only JSON-encodes the new text (and token ids / logprobs when asked
for). All outputs that reached the request since its last write go out as one event, in one
write: the streaming cost per client is one small encode and one send per engine step.
Each event is exactly the typed ``CompletionChunk`` / ``ChatCompletionChunk`` of ``cluster.openai_responses``
(a test holds them equal), written from a template instead: building the model per step would cost the hot
path a validation of every field.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Literal, Protocol

from cluster.openai_responses import NamedAlternatives, PromptEcho, Usage, logprobs_body

if TYPE_CHECKING:
    from cluster.openai_responses import ErrorResponse

_dumps = json.JSONEncoder(ensure_ascii=False, separators=(",", ":")).encode

DONE = b"data: [DONE]\n\n"


class Output(Protocol):
    """What the edge reads of an engine ``RequestOutput`` (read-only)."""

    @property
    def new_token_ids(self) -> tuple[int, ...]: ...

    @property
    def new_text(self) -> str: ...

    @property
    def new_logprobs(self) -> tuple[float, ...]: ...

    @property
    def new_top_logprobs(self) -> tuple[tuple[tuple[int, float], ...], ...]: ...

    @property
    def finish_reason(self) -> str | None: ...


def sse_event(body: ErrorResponse) -> bytes:
    """A whole body as one event (an error ending a stream)."""
    return b"data: " + body.to_json() + b"\n\n"


class ChunkEncoder:
    """Encodes a request's stream chunks: ``chunk(outputs)`` for a batch of outputs, ``usage(...)`` at the end."""

    def __init__(
        self,
        kind: Literal["completion", "chat"],
        request_id: str,
        model: str,
        created: int,
        *,
        logprobs: bool,
        token_ids: bool,
        include_usage: bool,
        token_text: Callable[[Sequence[int]], list[str]] | None = None,
        index: int = 0,
        alternatives_text: Callable[[Sequence[Sequence[tuple[int, float]]]], NamedAlternatives] | None = None,
    ):
        """``token_text``: the sampled tokens' texts for the logprobs (``cluster.openai_protocol.token_strings``);
        ``alternatives_text``: given when the request asked for ``top_logprobs``, names each alternative's token
        (``cluster.openai_protocol.alternative_strings``)."""
        self.kind = kind
        self.token_text = token_text
        self.alternatives_text = alternatives_text
        #: Characters of completion text already sent: where the next chunk's ``text_offset`` starts.
        self._text_sent = 0
        self.logprobs = logprobs
        self.token_ids = token_ids
        self.include_usage = include_usage
        obj = "text_completion" if kind == "completion" else "chat.completion.chunk"
        self._envelope = f'{{"id":{_dumps(request_id)},"object":"{obj}","created":{created},"model":{_dumps(model)}'
        self._head = (self._envelope + f',"choices":[{{"index":{index},"finish_reason":').encode()
        self._tail = ("}]" + (',"usage":null' if include_usage else "") + "}\n\n").encode()
        self._first = True

    def chunk(self, outputs: Sequence[Output], echo: PromptEcho | None = None) -> bytes:
        """One SSE event for all of ``outputs`` (text joined, ids and logprobs concatenated). ``echo``: the
        prompt, sent before the first outputs (completions' ``echo``; with logprobs, the prompt's go first)."""
        if len(outputs) == 1:
            out = outputs[0]
            text, ids, lps, finish = out.new_text, out.new_token_ids, out.new_logprobs, out.finish_reason
        else:
            text = "".join(o.new_text for o in outputs)
            ids = tuple(t for o in outputs for t in o.new_token_ids)
            lps = tuple(lp for o in outputs for lp in o.new_logprobs)
            finish = outputs[-1].finish_reason
        parts = [b"data: ", self._head, b"null" if finish is None else _dumps(finish).encode()]
        lp_json = b"null"
        if self.logprobs:
            tokens = self.token_text(ids) if self.token_text is not None else [""] * len(lps)
            all_lps: Sequence[float | None] = lps
            alternatives: NamedAlternatives | None = None
            if self.alternatives_text is not None:
                alternatives = self.alternatives_text([a for o in outputs for a in o.new_top_logprobs])
            if echo is not None:
                tokens, all_lps = [*echo.tokens, *tokens], [*echo.logprobs, *lps]
                alternatives = [*echo.alternatives, *alternatives] if alternatives is not None else None
            lp_json = logprobs_body(self.kind, tokens, all_lps, self._text_sent, alternatives).to_json()
        if echo is not None:
            text = echo.text + text
        if self.kind == "completion":
            parts += [b',"text":', _dumps(text).encode(), b',"logprobs":', lp_json]
        else:
            # The role goes in the first delta only, as OpenAI does.
            role = b'"role":"assistant",' if self._first else b""
            parts += [b',"delta":{', role, b'"content":', _dumps(text).encode(), b'},"logprobs":', lp_json]
        self._text_sent += len(text)
        if self.token_ids:
            parts += [b',"token_ids":', _dumps(list(ids)).encode()]
        parts.append(self._tail)
        self._first = False
        return b"".join(parts)

    def usage(self, usage: Usage) -> bytes:
        return b"data: " + (self._envelope + ',"choices":[],"usage":').encode() + usage.to_json() + b"}\n\n"
