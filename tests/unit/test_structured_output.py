"""Structured output (llguidance): JSON schema, JSON object, regex and choice constraints through the engine, and
the edge's mapping of response_format / guided_* with its 400s."""

from __future__ import annotations

import json
import random
import re

import jsonschema
import pytest

from bench.schemas import random_schema
from cluster.config import SamplingParams, StructuredOutput
from cluster.engine.llm_engine import LLMEngine
from cluster.errors import InvalidRequestError
from cluster.grammar import check_structured
from cluster.openai_protocol import ChatCompletionRequest, CompletionRequest
from tests.helpers import engine_config


@pytest.fixture(scope="module")
def engine(demo_model):
    return LLMEngine(engine_config(demo_model, num_blocks=256))


def test_twenty_random_schemas_give_outputs_that_validate(engine):
    rng = random.Random(7)
    schemas = [random_schema(rng) for _ in range(20)]
    prompts = [[5 + i, 40, 77, 120 + i] for i in range(20)]
    params = [
        SamplingParams(
            max_tokens=150,
            temperature=0.0 if i % 2 else 1.0,
            seed=i,
            structured=StructuredOutput("json_schema", json.dumps(s)),
        )
        for i, s in enumerate(schemas)
    ]
    for schema, out in zip(schemas, engine.generate(prompts, params), strict=True):  # one batch: masks batched
        assert out["finish_reason"] == "stop", out["text"]
        jsonschema.validate(json.loads(out["text"]), schema)


def test_json_object_regex_and_choice(engine):
    cases = [
        (StructuredOutput("json_object"), lambda t: isinstance(json.loads(t), dict)),
        (StructuredOutput("regex", r"[a-c]{2,5}-\d\d"), lambda t: re.fullmatch(r"[a-c]{2,5}-\d\d", t)),
        (
            StructuredOutput("choice", json.dumps(["yes", "no way", 'say "hi"'])),
            lambda t: t in ("yes", "no way", 'say "hi"'),
        ),
        # vLLM's guided_grammar: llama.cpp's GBNF and Lark
        (StructuredOutput("grammar", 'root ::= "ab" [0-9] [0-9]?'), lambda t: re.fullmatch(r"ab[0-9][0-9]?", t)),
        (StructuredOutput("grammar", 'start: ("x" | "yz")+ "!"'), lambda t: re.fullmatch(r"(x|yz)+!", t)),
    ]
    for structured, ok in cases:
        for seed in range(3):
            # A random-weight model sampling freely inside an open JSON object writes keys until max_tokens: greedy.
            temperature = 0.0 if structured.kind == "json_object" else 1.0
            params = SamplingParams(max_tokens=60, temperature=temperature, seed=seed, structured=structured)
            out = engine.generate([[9, 8, 7, seed + 5]], params)[0]
            assert out["finish_reason"] == "stop" and ok(out["text"]), (structured, out["text"])


def test_unconstrained_requests_in_the_same_batch_are_unchanged(engine):
    plain = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
    alone = engine.generate([[11, 12, 13]], plain)[0]["token_ids"]
    mixed = engine.generate(
        [[11, 12, 13], [14, 15]], [plain, SamplingParams(max_tokens=8, structured=StructuredOutput("json_object"))]
    )
    assert mixed[0]["token_ids"] == alone


@pytest.mark.parametrize(
    ("body", "param", "message"),
    [
        ({"response_format": {"type": "json_schema"}}, "response_format", "needs a json_schema"),
        (
            {"response_format": {"type": "json_schema", "json_schema": {"schema": {"type": "frob"}}}},
            "response_format",
            "frob",
        ),
        ({"guided_regex": "[a-"}, "guided_regex", "unclosed character class"),
        ({"guided_regex": "a", "guided_choice": ["b"]}, "guided_choice", "send one of them"),
        ({"guided_json": "{not json"}, "guided_json", "JSON schema"),
        ({"guided_choice": []}, "guided_choice", "at least 1"),
        ({"guided_grammar": "start: undefined_rule"}, "guided_grammar", "unknown name"),
        ({"structured_outputs": {"regex": "a", "choice": ["b"]}}, "structured_outputs", "sets 2 constraints"),
        ({"structured_outputs": {"json": "{nope"}}, "structured_outputs", "JSON schema"),
        # named as the client sent it, not as the guided_* field of the same kind
        ({"structured_outputs": {"regex": "[a-"}}, "structured_outputs", "unclosed character class"),
    ],
)
def test_the_edge_refuses_bad_constraints_naming_the_field(body, param, message):
    from cluster.openai_protocol import APIError, parse_body

    with pytest.raises((APIError, InvalidRequestError)) as e:
        req = parse_body(json.dumps({"model": "m", "prompt": "hi", **body}).encode(), CompletionRequest)
        check_structured(req.sampling_params(16).structured)
    assert e.value.param == param and message in str(e.value.message if hasattr(e.value, "message") else e.value)


def test_response_format_and_guided_fields_map_to_one_constraint():
    schema = {"type": "object", "properties": {"a": {"type": "integer"}}}
    chat = ChatCompletionRequest.model_validate(
        {
            "model": "m",
            "messages": [{"role": "user", "content": "hi"}],
            "response_format": {"type": "json_schema", "json_schema": {"name": "s", "schema": schema, "strict": True}},
        }
    )
    same = CompletionRequest.model_validate({"model": "m", "prompt": "hi", "guided_json": json.dumps(schema)})
    assert chat.sampling_params(16).structured == same.sampling_params(16).structured  # one compiled grammar
    newer = CompletionRequest.model_validate({"model": "m", "prompt": "hi", "structured_outputs": {"json": schema}})
    assert newer.sampling_params(16).structured == same.sampling_params(16).structured
    text = CompletionRequest.model_validate({"model": "m", "prompt": "hi", "response_format": {"type": "text"}})
    assert text.sampling_params(16).structured is None


def test_the_mask_fits_logits_wider_than_the_tokenizer(engine):
    """Many models' LM heads have more rows than their tokenizer has tokens; those ids are never allowed."""
    import torch

    from cluster.engine.structured import mask_logits

    grammar = engine.grammars.matcher(StructuredOutput("regex", "ab"))
    logits = torch.zeros(2, grammar.vocab_size + 64)
    mask_logits(logits, [None, grammar])
    allowed = (logits[1] > float("-inf")).nonzero().flatten().tolist()
    assert allowed and max(allowed) < grammar.vocab_size and (logits[0] == 0).all()
