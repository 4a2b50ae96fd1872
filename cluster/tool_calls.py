"""Tool calling: the request's tools, how ``tool_choice`` constrains the output, and the output's tool calls.

Three modes, as in vLLM:

- a named function (``{"type": "function", "function": {"name": ...}}``): the output is constrained to a JSON
  value of that function's ``parameters`` schema and becomes one call's ``arguments``;
- ``"required"``: the output is constrained to a JSON array of ``{"name", "parameters"}`` objects, one of the
  tools each, and becomes those calls;
- ``"auto"``: the model writes freely and the server's tool-call parser (``--tool-call-parser``: the format its
  model family was trained on) finds calls in the text; what is not a call stays the message's content.

``"none"`` leaves the output alone. The edge and ``run-batch`` share all of this. No torch.
"""

from __future__ import annotations

import json
import re
import uuid
from dataclasses import dataclass
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from cluster.config import StructuredOutput
from cluster.errors import InvalidRequestError

#: The parsers ``--tool-call-parser`` takes.
TOOL_CALL_PARSERS = ("hermes", "llama3_json")


class FunctionDefinition(BaseModel):
    model_config = ConfigDict(extra="ignore")
    name: str = Field(min_length=1, max_length=256)
    description: str | None = None
    parameters: dict[str, Any] | None = None


class Tool(BaseModel):
    model_config = ConfigDict(extra="ignore")
    type: Literal["function"] = "function"
    function: FunctionDefinition


class _FunctionName(BaseModel):
    name: str


class NamedToolChoice(BaseModel):
    model_config = ConfigDict(extra="ignore")
    type: Literal["function"] = "function"
    function: _FunctionName


ToolChoice = Literal["none", "auto", "required"] | NamedToolChoice


@dataclass(frozen=True)
class ToolCall:
    name: str
    #: The arguments as JSON text (OpenAI's ``function.arguments``).
    arguments: str
    id: str = ""

    def body(self) -> dict[str, Any]:
        return {"id": self.id, "type": "function", "function": {"name": self.name, "arguments": self.arguments}}


@dataclass(frozen=True)
class ToolMode:
    """What a chat request asks of tools: ``kind`` none / auto / required / named (``name``)."""

    kind: Literal["none", "auto", "required", "named"]
    tools: tuple[Tool, ...] = ()
    name: str | None = None
    #: OpenAI's ``parallel_tool_calls``: False allows at most one call ("required" enforces it in the grammar).
    parallel: bool = True


def tool_mode(
    tools: list[Tool] | None, tool_choice: ToolChoice | None, parser: str | None, parallel: bool | None = None
) -> ToolMode:
    """The request's mode; InvalidRequestError naming the field when it cannot be served."""
    tools = tools or []
    if tool_choice is None:
        tool_choice = "auto" if tools else "none"
    if tool_choice == "none":
        return ToolMode("none", tuple(tools))
    if not tools:
        raise InvalidRequestError("tool_choice needs tools: send the functions the model may call", "tool_choice")
    if isinstance(tool_choice, NamedToolChoice):
        name = tool_choice.function.name
        if name not in {t.function.name for t in tools}:
            raise InvalidRequestError(f"tool_choice names {name!r}, which is not one of the tools", "tool_choice")
        return ToolMode("named", tuple(tools), name)
    if tool_choice == "auto" and parser is None:
        raise InvalidRequestError(
            'tool_choice "auto" needs the server started with --tool-call-parser (one of '
            f"{', '.join(TOOL_CALL_PARSERS)}: the call format the model was trained on); or name a function, or "
            'use "required"',
            "tool_choice",
        )
    return ToolMode(tool_choice, tuple(tools), parallel=parallel is not False)


def constraint(mode: ToolMode) -> StructuredOutput | None:
    """The grammar that enforces ``required`` and a named function (None for auto / none)."""
    if mode.kind == "named":
        tool = next(t for t in mode.tools if t.function.name == mode.name)
        return StructuredOutput.from_schema(_parameters(tool))
    if mode.kind == "required":
        # Each function's parameters sit deep inside the array's schema, so their local references ("#/$defs/X",
        # "#") would resolve against the array: such parameters move to the array's own $defs, references rewritten.
        defs: dict[str, Any] = {}
        calls = []
        for i, t in enumerate(mode.tools):
            parameters = _parameters(t)
            if _has_ref(parameters):
                key = f"tool{i}"  # per tool: two tools' own "$defs/Unit" stay apart
                defs[key] = _relocated(parameters, f"#/$defs/{key}", t.function.name)
                parameters = {"$ref": f"#/$defs/{key}"}
            calls.append(
                {
                    "type": "object",
                    "properties": {"name": {"enum": [t.function.name]}, "parameters": parameters},
                    "required": ["name", "parameters"],
                    "additionalProperties": False,
                }
            )
        array: dict[str, Any] = {"type": "array", "minItems": 1, "items": {"anyOf": calls}}
        if defs:
            array["$defs"] = defs
        if not mode.parallel:
            array["maxItems"] = 1
        return StructuredOutput.from_schema(array)
    return None


def parse_output(mode: ToolMode, text: str, parser: str | None) -> tuple[str | None, list[ToolCall]]:
    """(content, tool calls) of a finished output under ``mode``."""
    if mode.kind == "named":
        return None, [_call(mode.name or "", _arguments_text(text))]
    if mode.kind == "required":
        try:
            return None, [_call(c["name"], json.dumps(c["parameters"])) for c in json.loads(text)]
        except (ValueError, TypeError, KeyError):  # cut off by max_tokens: not a complete array
            return text, []
    if mode.kind == "auto" and parser == "hermes":
        return _parse_hermes(text)
    if mode.kind == "auto" and parser == "llama3_json":
        return _parse_llama3_json(text)
    return text, []


def template_tools(mode: ToolMode) -> list[dict[str, Any]] | None:
    """The tools as chat templates take them (OpenAI's shape), or None without tools."""
    return [t.model_dump(exclude_none=True) for t in mode.tools] or None


# ---- parsers --------------------------------------------------------------------------------------------------

_HERMES_CALL = re.compile(r"<tool_call>\s*(.*?)\s*</tool_call>", re.DOTALL)


def _parse_hermes(text: str) -> tuple[str | None, list[ToolCall]]:
    """Hermes / Qwen: ``<tool_call>{"name": ..., "arguments": {...}}</tool_call>`` blocks; text before the first
    block is content. A block that is not such JSON stays in the content."""
    calls = []
    for block in _HERMES_CALL.findall(text):
        try:
            obj = json.loads(block)
            calls.append(_call(obj["name"], json.dumps(obj.get("arguments", {}))))
        except (ValueError, TypeError, KeyError):
            return text, []
    if not calls:
        return text, []
    content = text[: text.find("<tool_call>")].strip()
    return content or None, calls


def _parse_llama3_json(text: str) -> tuple[str | None, list[ToolCall]]:
    """Llama 3.x JSON tool calling: the whole output is ``{"name": ..., "parameters": {...}}`` (optionally after
    ``<|python_tag|>``), or several separated by ``;``."""
    body = text.strip().removeprefix("<|python_tag|>").strip()
    calls = []
    try:
        for part in (p for p in body.split(";") if p.strip()):
            obj = json.loads(part)
            args = obj.get("parameters", obj.get("arguments", {}))
            calls.append(_call(obj["name"], json.dumps(args)))
    except (ValueError, TypeError, KeyError, AttributeError):
        return text, []
    return (None, calls) if calls else (text, [])


def _call(name: str, arguments: str) -> ToolCall:
    return ToolCall(name, arguments, f"call_{uuid.uuid4().hex[:24]}")


def _arguments_text(text: str) -> str:
    try:
        return json.dumps(json.loads(text))
    except ValueError:  # cut off by max_tokens: handed back as generated
        return text


def _parameters(tool: Tool) -> dict[str, Any]:
    return tool.function.parameters or {"type": "object"}


#: Keywords whose value is data, not a schema: a "$ref" key inside them is no reference.
_DATA_KEYWORDS = frozenset({"enum", "const", "default", "examples"})
#: Keywords whose value maps names (which may be any string, "enum" included) to schemas.
_SCHEMA_MAPS = frozenset(
    {"properties", "patternProperties", "$defs", "definitions", "dependentSchemas", "dependencies"}
)


def _has_ref(node: Any, names: bool = False) -> bool:
    """Whether schema ``node`` (a map of names to schemas when ``names``) holds a "$ref"."""
    if isinstance(node, list):
        return any(_has_ref(v) for v in node)
    if not isinstance(node, dict):
        return False
    if names:
        return any(_has_ref(v) for v in node.values())
    return any(
        (k == "$ref" and isinstance(v, str)) or (k not in _DATA_KEYWORDS and _has_ref(v, k in _SCHEMA_MAPS))
        for k, v in node.items()
    )


def _relocated(schema: dict[str, Any], base: str, tool: str) -> dict[str, Any]:
    """``schema`` (a tool's parameters) to be placed at JSON pointer ``base``: its local references ("#" and
    "#/...") rewritten to point under ``base``. InvalidRequestError naming the tool for references that cannot be
    rewritten (another document, an anchor, under a nested "$id"): refusing beats a constraint that means
    something else. Does not modify ``schema``."""

    def walk(node: Any, root: bool) -> Any:
        if isinstance(node, list):
            return [walk(v, False) for v in node]
        if not isinstance(node, dict):
            return node
        out: dict[str, Any] = {}
        for k, v in node.items():
            if k == "$id" and isinstance(v, str):
                if root:
                    continue  # the parameters' own document: its "#..." references are rewritten below
                raise _unmovable(tool, f'a nested "$id" ({v})')
            if k == "$ref" and isinstance(v, str):
                if v != "#" and not v.startswith("#/"):
                    raise _unmovable(tool, f"the reference {v!r}")
                out[k] = base + v[1:]
            elif k in _DATA_KEYWORDS:
                out[k] = v
            elif k in _SCHEMA_MAPS and isinstance(v, dict):
                out[k] = {name: walk(sub, False) for name, sub in v.items()}
            else:
                out[k] = walk(v, False)
        return out

    return walk(schema, True)


def _unmovable(tool: str, what: str) -> InvalidRequestError:
    return InvalidRequestError(
        f'tool {tool!r}: tool_choice "required" cannot combine these parameters with the other tools because of '
        f'{what}; use local "#/$defs/..." references',
        "tools",
    )
