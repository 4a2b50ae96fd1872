"""Structured-output constraints as llguidance grammars: built and checked once, shared by the edge and the engine.

``grammar_for`` turns a ``StructuredOutput`` into llguidance's grammar text (JSON schema, regex, or a Lark
alternation for a choice); ``check_structured`` is the edge's 400 for a schema or pattern llguidance cannot
compile. The engine builds its per-request matchers from the same text (``cluster.engine.structured``).
No torch here: the HTTP edge imports this.

Compiling costs grow with the spec (100,000 choices as rule alternatives took ~9 s to check and ~9 s more to build
a matcher): the edge and the engine both compile on worker threads (llguidance drops the GIL meanwhile), never on
the event loop or the thread that steps; a spec is bounded in size before anything compiles it; and llguidance
runs under one set of limits (``PARSER_LIMITS``) at the edge and in the engine alike.
"""

from __future__ import annotations

import functools
import json
from typing import TYPE_CHECKING

import llguidance
from llguidance.gbnf_to_lark import GbnfToLarkError, any_to_lark

if TYPE_CHECKING:
    from llguidance._lib import JsonCompileOptions

from cluster.config import StructuredOutput
from cluster.errors import InvalidRequestError

#: The largest spec (schema JSON, pattern, grammar text, the JSON list of choices) a request may send, in bytes:
#: ~20,000 choices of 20 characters, which check in ~0.1 s here; a schema llguidance finds too large past it is
#: refused by llguidance itself.
MAX_SPEC_BYTES = 512 * 1024

#: llguidance's defaults, without the parser state in error messages (they reach the client, and the state dump
#: is llguidance's internals, not something a client can act on).
PARSER_LIMITS = llguidance.LLParserLimits(verbose_errors=False)

#: JSON without free whitespace between tokens: still any valid JSON value of the schema, but a model cannot
#: spend its max_tokens on blank lines (a known failure of flexible-whitespace JSON grammars). A schema may
#: ask otherwise with llguidance's own ``"x-guidance": {"whitespace_flexible": true}``.
_JSON_OPTIONS: JsonCompileOptions = {"whitespace_flexible": False}


#: Specs (and their grammars) kept compiled: a service sees the same few again and again; 64 of the largest specs
#: allowed keep ~100 MB at most.
_CACHED_SPECS = 64


@functools.lru_cache(maxsize=_CACHED_SPECS)
def grammar_for(structured: StructuredOutput) -> str:
    """llguidance grammar text for ``structured`` (cached: a service sees the same few schemas again and again).
    Raises ValueError / TypeError for a spec that is not a schema / pattern / grammar / list of strings: call
    ``check_structured`` first."""
    if structured.kind == "json_schema":
        return llguidance.LLMatcher.grammar_from_json_schema(json.loads(structured.spec), defaults=_JSON_OPTIONS)
    if structured.kind == "json_object":
        return llguidance.LLMatcher.grammar_from_json_schema({"type": "object"}, defaults=_JSON_OPTIONS)
    if structured.kind == "regex":
        return llguidance.LLMatcher.grammar_from_regex(structured.spec)
    if structured.kind == "grammar":
        # vLLM's guided_grammar takes llama.cpp's GBNF (xgrammar) or Lark (guidance): both are read here.
        try:
            lark = any_to_lark(structured.spec)
        except GbnfToLarkError as e:
            raise ValueError(str(e)) from None
        except Exception as e:  # noqa: BLE001 - the converter raises a bare Exception for e.g. no 'root' rule
            raise ValueError(str(e) or type(e).__name__) from None
        return llguidance.LLMatcher.grammar_from_lark(lark)
    choices = json.loads(structured.spec)
    # One terminal, not one rule per choice: the lexer matches the alternation, where a rule's alternatives all
    # sit in one parser row, which llguidance caps at 2000 items (more choices failed at the first token), and
    # which compiled ~10x slower. Lark string literals take JSON's escapes, so any choice text is written exactly.
    alternatives = " | ".join(json.dumps(c) for c in choices)
    return llguidance.LLMatcher.grammar_from_lark(f"start: CHOICE\nCHOICE: {alternatives}")


def check_structured(structured: StructuredOutput | None, field: str | None = None) -> None:
    """Raises InvalidRequestError (400) naming ``field`` (by default the guided_* field of its kind) when
    llguidance would refuse the grammar."""
    if structured is None:
        return
    name = field or request_field(structured)
    try:
        size = len(structured.spec.encode())
    except UnicodeEncodeError as e:  # a lone surrogate (JSON's "\ud800"): no text llguidance can compile
        bad = structured.spec[e.start : e.end].encode("unicode_escape").decode()
        raise InvalidRequestError(f"the {name} contains {bad}, a lone surrogate, which is not text", name) from None
    if size > MAX_SPEC_BYTES:
        raise InvalidRequestError(
            f"the {name} is {size} bytes; at most {MAX_SPEC_BYTES} are accepted (a smaller schema, pattern or list "
            "of choices compiles in bounded time)",
            name,
        )
    problem = _problem(structured)
    if problem is not None:
        raise InvalidRequestError(f"the {name} cannot be compiled: {problem}", name)


@functools.lru_cache(maxsize=_CACHED_SPECS)
def _problem(structured: StructuredOutput) -> str | None:
    try:
        grammar = grammar_for(structured)
        is_error, messages = llguidance.LLMatcher.validate_grammar_with_warnings(grammar, limits=PARSER_LIMITS)
    except (ValueError, TypeError) as e:
        return str(e)
    except BaseException as e:  # noqa: BLE001 - a Rust panic in llguidance arrives as pyo3's PanicException,
        if type(e).__name__ != "PanicException":  # a BaseException: the spec broke the compiler, not the server
            raise
        return f"llguidance could not compile it ({str(e).splitlines()[0] if str(e) else 'panic'})"
    return "; ".join(messages).strip() if is_error else None


def request_field(structured: StructuredOutput) -> str:
    """The request field the constraint came from (errors name it): the one it says, else the usual one of its
    kind."""
    if structured.param is not None:
        return structured.param
    names = {"json_schema": "response_format", "json_object": "response_format", "regex": "guided_regex"}
    return names.get(structured.kind, "guided_grammar" if structured.kind == "grammar" else "guided_choice")
