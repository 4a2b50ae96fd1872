"""Property-based fuzzing of the OpenAI endpoints: whatever a client sends, no 5xx, no hang, and the server
serves the same greedy output for a fixed probe request afterwards.

    python -m bench.fuzz_http --base-url http://127.0.0.1:8000 --model demo --examples 3000

Bodies come from hypothesis strategies (``request_bodies``): well-formed requests with hostile values in
every field (huge, negative, wrong-typed numbers; lone surrogates; token ids outside the vocabulary; deep
nesting; unknown roles and fields), and bytes that are not JSON at all. A test runs a few hundred examples
against a live server in CI (tests/integration/test_cli_server.py); this command runs more.
"""

from __future__ import annotations

import argparse
import json
import re
import sys
from typing import Any

import httpx
from hypothesis import strategies as st

#: What a well-behaved server may answer to anything (OpenAI's status codes for client errors and overload).
ALLOWED_STATUS = {200, 400, 404, 413, 422, 429}
#: Keeps accepted requests cheap: the fuzzer tests the edge, not the engine's throughput.
MAX_TOKENS_CAP = 8

_HOSTILE_NUMBERS = st.sampled_from(
    [0, -1, 1, 2**31, 2**63, 2**64, 18446744073709551616, -(2**63), 1e308, -1e308, 0.5, float("nan"), float("inf")]
)
_HOSTILE_TEXT = st.one_of(
    st.sampled_from(["", "\ud800", "a\udfffb", "\x00", "\u202e", "🙂" * 50, "<s></s>"]),
    st.integers(10_000, 40_000).map(lambda n: "x" * n),  # long text: tokenized off the event loop
)
_ANY_SCALAR = st.one_of(st.none(), st.booleans(), _HOSTILE_NUMBERS, _HOSTILE_TEXT, st.text(max_size=20))


#: Stands for ``[[[...1...]]]`` nested ``depth`` deep in a body; spliced into the JSON text after encoding
#: (deeper than the json module writes).
_NESTED = "@@nested-{}@@"


def _nested(depth: int) -> str:
    return _NESTED.format(depth)


def _number(lo: float, hi: float) -> st.SearchStrategy:
    return st.one_of(st.floats(lo, hi, allow_nan=False), _HOSTILE_NUMBERS, _ANY_SCALAR)


def _prompt(vocab_size: int) -> st.SearchStrategy:
    ids = st.lists(st.integers(-5, vocab_size + 5) | _HOSTILE_NUMBERS, max_size=40)
    return st.one_of(
        st.text(max_size=200),
        _HOSTILE_TEXT,
        ids,
        st.lists(ids, max_size=3),  # a batch of token-id prompts
        st.lists(st.text(max_size=20), max_size=3),
        st.builds(_nested, st.integers(1, 3000)),
        _ANY_SCALAR,
    )


def _sampling_fields() -> st.SearchStrategy:
    return st.fixed_dictionaries(
        {},
        optional={
            "max_tokens": st.one_of(st.integers(1, MAX_TOKENS_CAP), _HOSTILE_NUMBERS, _ANY_SCALAR),
            "temperature": _number(0, 2),
            "top_p": _number(0, 1),
            "top_k": st.one_of(st.integers(-2, 100), _HOSTILE_NUMBERS),
            "seed": st.one_of(st.integers(0, 2**32), _HOSTILE_NUMBERS, _ANY_SCALAR),
            "stop": st.one_of(st.text(max_size=5), st.lists(st.text(max_size=5), max_size=5), _ANY_SCALAR),
            "stream": st.one_of(st.booleans(), _ANY_SCALAR),
            "stream_options": st.one_of(st.just({"include_usage": True}), _ANY_SCALAR),
            "logprobs": st.one_of(st.booleans(), st.integers(-1, 30), _ANY_SCALAR),
            "n": st.one_of(st.integers(-1, 4), _ANY_SCALAR),
            "ignore_eos": st.booleans(),
            "presence_penalty": _number(-2, 2),
            "unknown_field": _ANY_SCALAR,
        },
    )


def _valid_fields() -> st.SearchStrategy:
    """Sampling fields a server must accept: these requests reach the engine (streamed or not)."""
    return st.fixed_dictionaries(
        {"max_tokens": st.integers(1, MAX_TOKENS_CAP)},
        optional={
            "temperature": st.floats(0, 2),
            "top_p": st.floats(0.05, 1),
            "top_k": st.sampled_from([-1, 1, 5, 50]),
            "seed": st.integers(0, 2**31),
            "stop": st.lists(st.text(min_size=1, max_size=3), max_size=2),
            "stream": st.booleans(),
            "logprobs": st.booleans(),
            "ignore_eos": st.booleans(),
        },
    )


def _valid_completion(model: str, vocab_size: int) -> st.SearchStrategy:
    prompt = st.one_of(
        st.text(min_size=1, max_size=200), st.lists(st.integers(4, vocab_size - 1), min_size=1, max_size=60)
    )
    return st.builds(lambda p, f: {"model": model, "prompt": p, **f}, prompt, _valid_fields())


def _valid_chat(model: str) -> st.SearchStrategy:
    message = st.fixed_dictionaries(
        {"role": st.sampled_from(["system", "user", "assistant"]), "content": st.text(min_size=1, max_size=100)}
    )
    return st.builds(
        lambda msgs, f: {"model": model, "messages": msgs, **f},
        st.lists(message, min_size=1, max_size=3),
        _valid_fields(),
    )


def _completion(model: str, vocab_size: int) -> st.SearchStrategy:
    return st.builds(
        lambda m, p, f: {"model": m, "prompt": p, **f},
        st.one_of(st.just(model), _ANY_SCALAR),
        _prompt(vocab_size),
        _sampling_fields(),
    )


def _message() -> st.SearchStrategy:
    content = st.one_of(
        st.text(max_size=100),
        _HOSTILE_TEXT,
        st.lists(st.fixed_dictionaries({"type": st.just("text"), "text": st.text(max_size=20)}), max_size=3),
        _ANY_SCALAR,
    )
    role = st.one_of(st.sampled_from(["system", "user", "assistant", "developer", "tool"]), _ANY_SCALAR)
    return st.one_of(st.fixed_dictionaries({"role": role, "content": content}), _ANY_SCALAR)


def _chat(model: str) -> st.SearchStrategy:
    messages = st.one_of(st.lists(_message(), max_size=4), st.builds(_nested, st.integers(1, 3000)), _ANY_SCALAR)
    return st.builds(
        lambda m, msgs, f: {"model": m, "messages": msgs, **f},
        st.one_of(st.just(model), _ANY_SCALAR),
        messages,
        _sampling_fields(),
    )


def _encode(body: Any) -> bytes:
    """JSON as a client library writes it: lone surrogates as \\u escapes (the server sees them in valid JSON),
    NaN and infinities as JavaScript literals (which strict JSON parsers refuse), nesting markers spliced in."""
    text = json.dumps(body)
    for match in re.finditer(r'"@@nested-(\d+)@@"', text):
        depth = int(match.group(1))
        text = text.replace(match.group(0), "[" * depth + "1" + "]" * depth, 1)
    return text.encode()


def request_bodies(model: str, vocab_size: int) -> st.SearchStrategy:
    """(path, raw body) pairs: valid requests, requests with hostile values, and bytes that are not JSON, about
    equally often on each endpoint."""
    completions, chat = "/v1/completions", "/v1/chat/completions"
    raw = st.one_of(st.binary(max_size=200), st.just(b'{"model": "x", "prompt": '), st.just(b"[" * 100000))
    return st.one_of(
        st.tuples(st.just(completions), _valid_completion(model, vocab_size).map(_encode)),
        st.tuples(st.just(chat), _valid_chat(model).map(_encode)),
        st.tuples(st.just(completions), _completion(model, vocab_size).map(_encode)),
        st.tuples(st.just(chat), _chat(model).map(_encode)),
        st.tuples(st.sampled_from([completions, chat]), raw),
    )


def check_exchange(client: httpx.Client, base_url: str, path: str, body: bytes) -> int:
    """Sends one request (reading a stream to its end); asserts an allowed status and, for errors, an OpenAI
    error body. Returns the status."""
    headers = {"content-type": "application/json"}
    with client.stream("POST", base_url + path, content=body, headers=headers, timeout=60) as resp:
        content = resp.read()
    assert resp.status_code in ALLOWED_STATUS, (resp.status_code, content[:500], body[:300])
    if resp.status_code != 200:
        error = json.loads(content)["error"]
        assert isinstance(error["message"], str) and error["message"], content[:300]
    elif resp.headers.get("content-type", "").startswith("text/event-stream"):
        assert content.rstrip().endswith(b"data: [DONE]"), content[-300:]
    return resp.status_code


def probe(client: httpx.Client, base_url: str, model: str) -> list[int]:
    """A fixed greedy request; its token ids must not change whatever the fuzzer sent in between."""
    body = {"model": model, "prompt": [5, 17, 33, 80, 9], "max_tokens": 6, "temperature": 0, "ignore_eos": True}
    resp = client.post(f"{base_url}/v1/completions", json={**body, "return_token_ids": True}, timeout=60)
    assert resp.status_code == 200, resp.text
    return resp.json()["choices"][0]["token_ids"]


def main() -> int:
    from hypothesis import HealthCheck, given, settings

    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--base-url", default="http://127.0.0.1:8000")
    ap.add_argument("--model", default="demo")
    ap.add_argument("--vocab-size", type=int, default=512)
    ap.add_argument("--examples", type=int, default=3000)
    args = ap.parse_args()
    statuses: dict[int, int] = {}
    with httpx.Client() as client:
        before = probe(client, args.base_url, args.model)

        @settings(max_examples=args.examples, deadline=None, suppress_health_check=list(HealthCheck))
        @given(request_bodies(args.model, args.vocab_size))
        def fuzz(exchange: tuple[str, bytes]) -> None:
            status = check_exchange(client, args.base_url, *exchange)
            statuses[status] = statuses.get(status, 0) + 1

        fuzz()
        assert client.get(f"{args.base_url}/health", timeout=10).status_code == 200
        after = probe(client, args.base_url, args.model)
    print(f"{sum(statuses.values())} requests; statuses {dict(sorted(statuses.items()))}")
    print(f"probe before == after: {before == after} ({before})")
    return 0 if before == after else 1


if __name__ == "__main__":
    sys.exit(main())
