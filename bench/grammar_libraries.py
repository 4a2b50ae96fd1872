"""llguidance against xgrammar on the work structured output does per request and per step, in one run.

    python -m bench.grammar_libraries [--tokenizer DIR] [--schemas 20] [--steps 64]

For each library that imports (xgrammar is not a shapeserve dependency: run this with a Python that has both,
e.g. the vLLM bench venv of ``bench/compare_vllm.sh``), on the same tokenizer and the same random JSON schemas
(``bench.schemas.random_schema``):

- compile: grammar construction + matcher for a new schema, ms (the cost a request with a new schema pays);
- mask: one next-token bitmask, us (the per-step cost per constrained request), walking a valid instance of the
  schema token by token.

Prints min / median / max per library. The choice this informed is recorded in docs/benchmarks.md.
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import sys
import time

from transformers import AutoTokenizer

from bench.schemas import random_schema


def _instance(schema: dict, rng: random.Random):
    """A short valid instance of a ``random_schema`` schema."""
    if "enum" in schema:
        return schema["enum"][0]
    kind = schema.get("type")
    if kind == "object":
        return {k: _instance(v, rng) for k, v in schema["properties"].items()}
    if kind == "integer":
        return schema.get("minimum", 0)
    if kind == "boolean":
        return True
    if kind == "string":
        return "ab"[: schema.get("maxLength", 2)]
    if kind == "array":
        return [True]
    raise ValueError(schema)


def bench_llguidance(tokenizer, schemas, texts) -> tuple[list[float], list[float]]:
    import llguidance
    import llguidance.hf
    import llguidance.torch

    lltok = llguidance.hf.from_tokenizer(tokenizer)
    compile_ms, mask_us = [], []
    bitmask = llguidance.torch.allocate_token_bitmask(1, lltok.vocab_size)
    for schema, text in zip(schemas, texts, strict=True):
        t0 = time.perf_counter()
        grammar = llguidance.LLMatcher.grammar_from_json_schema(schema, defaults={"whitespace_flexible": False})
        matcher = llguidance.LLMatcher(lltok, grammar)
        compile_ms.append((time.perf_counter() - t0) * 1e3)
        for token in tokenizer(text, add_special_tokens=False).input_ids:
            t0 = time.perf_counter()
            llguidance.torch.fill_next_token_bitmask(matcher, bitmask, 0)
            mask_us.append((time.perf_counter() - t0) * 1e6)
            if not matcher.consume_token(token):
                break
    return compile_ms, mask_us


def bench_xgrammar(tokenizer, schemas, texts) -> tuple[list[float], list[float]]:
    import xgrammar

    info = xgrammar.TokenizerInfo.from_huggingface(tokenizer, vocab_size=len(tokenizer))
    compiler = xgrammar.GrammarCompiler(info, cache_enabled=False)
    compile_ms, mask_us = [], []
    bitmask = xgrammar.allocate_token_bitmask(1, info.vocab_size)
    for schema, text in zip(schemas, texts, strict=True):
        t0 = time.perf_counter()
        compiled = compiler.compile_json_schema(json.dumps(schema), any_whitespace=False)
        matcher = xgrammar.GrammarMatcher(compiled)
        compile_ms.append((time.perf_counter() - t0) * 1e3)
        for token in tokenizer(text, add_special_tokens=False).input_ids:
            t0 = time.perf_counter()
            matcher.fill_next_token_bitmask(bitmask)
            mask_us.append((time.perf_counter() - t0) * 1e6)
            if not matcher.accept_token(token):
                break
    return compile_ms, mask_us


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--tokenizer", default=".bench-models/llama-512h-8l", help="a model directory (its tokenizer)")
    ap.add_argument("--schemas", type=int, default=20)
    args = ap.parse_args()
    rng = random.Random(3)
    schemas = [random_schema(rng) for _ in range(args.schemas)]
    texts = [json.dumps(_instance(s, rng), separators=(",", ":")) for s in schemas]
    tokenizer = AutoTokenizer.from_pretrained(args.tokenizer)
    print(f"tokenizer {args.tokenizer} ({len(tokenizer)} tokens), {len(schemas)} random schemas")
    print(
        f"{'library':12} {'compile ms min':>15} {'median':>8} {'max':>8} {'mask us min':>12} {'median':>8} {'max':>8}"
    )
    for name, fn in (("llguidance", bench_llguidance), ("xgrammar", bench_xgrammar)):
        try:
            compile_ms, mask_us = fn(tokenizer, schemas, texts)
        except ImportError as e:
            print(f"{name:12} not installed here ({e})")
            continue
        c, m = compile_ms, mask_us
        print(
            f"{name:12} {min(c):15.2f} {statistics.median(c):8.2f} {max(c):8.2f} "
            f"{min(m):12.1f} {statistics.median(m):8.1f} {max(m):8.1f}"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
