"""Structured-output constraints as llguidance grammars: built and checked once, shared by the edge and the engine.

``grammar_for`` turns a ``StructuredOutput`` into llguidance's grammar text (JSON schema, regex, or a Lark
alternation for a choice); ``check_structured`` is the edge's 400 for a schema or pattern llguidance cannot
compile. The engine builds its per-request matchers from the same text (``cluster.engine.structured``).
No torch here: the HTTP edge imports this.
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

#: JSON without free whitespace between tokens: still any valid JSON value of the schema, but a model cannot
#: spend its max_tokens on blank lines (a known failure of flexible-whitespace JSON grammars). A schema may
#: ask otherwise with llguidance's own ``"x-guidance": {"whitespace_flexible": true}``.
_JSON_OPTIONS: JsonCompileOptions = {"whitespace_flexible": False}


@functools.lru_cache(maxsize=256)
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
            return llguidance.LLMatcher.grammar_from_lark(any_to_lark(structured.spec))
        except GbnfToLarkError as e:
            raise ValueError(str(e)) from None
    choices = json.loads(structured.spec)
    # Lark string literals take JSON's escapes, so any choice text is written exactly.
    return llguidance.LLMatcher.grammar_from_lark("start: " + " | ".join(json.dumps(c) for c in choices))


def check_structured(structured: StructuredOutput | None, field: str | None = None) -> None:
    """Raises InvalidRequestError (400) naming ``field`` (by default the guided_* field of its kind) when
    llguidance would refuse the grammar."""
    if structured is None:
        return
    problem = _problem(structured)
    if problem is not None:
        name = field or _field(structured)
        raise InvalidRequestError(f"the {name} cannot be compiled: {problem}", name)


@functools.lru_cache(maxsize=256)
def _problem(structured: StructuredOutput) -> str | None:
    try:
        grammar = grammar_for(structured)
    except (ValueError, TypeError) as e:
        return str(e)
    is_error, messages = llguidance.LLMatcher.validate_grammar_with_warnings(grammar)
    return "; ".join(messages).strip() if is_error else None


def _field(structured: StructuredOutput) -> str:
    names = {"json_schema": "response_format", "json_object": "response_format", "regex": "guided_regex"}
    return names.get(structured.kind, "guided_grammar" if structured.kind == "grammar" else "guided_choice")
