"""Random JSON schemas with short instances: structured-output tests and ``bench.grammar_libraries`` share them."""

from __future__ import annotations

import random


def random_schema(rng: random.Random, depth: int = 0) -> dict:
    """An object schema whose every instance is short (bounded strings, arrays and integers)."""

    def leaf() -> dict:
        kind = rng.choice(["integer", "boolean", "enum", "string", "array"] + (["object"] if depth < 1 else []))
        if kind == "integer":
            low = rng.randint(-50, 50)
            return {"type": "integer", "minimum": low, "maximum": low + rng.randint(0, 500)}
        if kind == "enum":
            return {"enum": rng.sample(["red", "green", "blue", "a b", 'q"uote'], rng.randint(1, 3))}
        if kind == "string":
            return {"type": "string", "maxLength": rng.randint(1, 6)}
        if kind == "array":
            return {"type": "array", "items": {"type": "boolean"}, "maxItems": rng.randint(1, 3)}
        if kind == "object":
            return random_schema(rng, depth + 1)
        return {"type": kind}

    names = rng.sample(["id", "name", "ok", "tags", "size", "inner", "x"], rng.randint(1, 4))
    properties = {n: leaf() for n in names}
    required = [n for n in names if rng.random() < 0.7]
    return {"type": "object", "properties": properties, "required": required, "additionalProperties": False}
