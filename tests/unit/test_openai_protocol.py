"""Request validation at the edge and the OpenAI-style error bodies (no Ray)."""

import json

import pytest

from cluster.config import EngineConfig
from cluster.errors import ConfigError, InvalidRequestError
from cluster.openai_protocol import APIError, ChatCompletionRequest, CompletionRequest, parse_body
from cluster.openai_responses import error_response
from cluster.serving.config import ServeConfig, load_serve_config, parse_serve_config


def body(**kw):
    return json.dumps(kw).encode()


def test_malformed_json_is_400_with_openai_body():
    with pytest.raises(APIError) as e:
        parse_body(b"{not json", CompletionRequest)
    assert e.value.status == 400
    written = json.loads(e.value.body().to_json())
    assert set(written["error"]) == {"message", "type", "param", "code"}
    assert written["error"]["type"] == "invalid_request_error"


def test_missing_field_names_it():
    with pytest.raises(APIError) as e:
        parse_body(body(model="m"), CompletionRequest)
    assert e.value.param == "prompt" and "missing" in e.value.message


def test_wrong_type_names_field():
    with pytest.raises(APIError) as e:
        parse_body(body(model="m", prompt="hi", max_tokens="many"), CompletionRequest)
    assert e.value.param == "max_tokens"


@pytest.mark.parametrize(
    "field,value", [("n", 65), ("n", 0), ("logprobs", 21), ("presence_penalty", 2.5), ("prompt", "")]
)
def test_unsupported_values_are_400(field, value):
    kw = {"model": "m", "prompt": "hi", field: value}
    with pytest.raises(APIError) as e:
        parse_body(body(**kw), CompletionRequest)
    assert e.value.param == field


def test_sampling_params_and_extensions():
    req = parse_body(
        body(
            model="m",
            prompt=[5, 6, 7],
            max_tokens=3,
            temperature=0,
            top_k=5,
            seed=1,
            ignore_eos=True,
            stop="x",
            return_token_ids=True,
            stream=True,
            stream_options={"include_usage": True},
        ),
        CompletionRequest,
    )
    p = req.sampling_params(default_max_tokens=16)
    assert (p.max_tokens, p.temperature, p.top_k, p.seed, p.ignore_eos, p.stop) == (3, 0.0, 5, 1, True, ("x",))
    assert req.prompt == [5, 6, 7] and req.include_usage and req.return_token_ids


def test_sampling_params_invalid_raise_named_error():
    req = parse_body(body(model="m", prompt="hi", top_p=0), CompletionRequest)
    with pytest.raises(InvalidRequestError) as e:
        req.sampling_params(16)
    assert e.value.param == "top_p"
    req = parse_body(body(model="m", prompt="hi", max_tokens=0), CompletionRequest)
    with pytest.raises(InvalidRequestError):
        req.sampling_params(16)


def test_chat_max_completion_tokens_wins_and_parts_join():
    req = parse_body(
        body(
            model="m",
            max_tokens=5,
            max_completion_tokens=7,
            messages=[{"role": "user", "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]}],
        ),
        ChatCompletionRequest,
    )
    assert req.sampling_params(16).max_tokens == 7
    assert req.conversation() == [{"role": "user", "content": "ab"}]


def test_chat_requires_messages():
    with pytest.raises(APIError) as e:
        parse_body(body(model="m", messages=[]), ChatCompletionRequest)
    assert e.value.param == "messages"


def test_chat_roles_outside_openai_are_400():
    with pytest.raises(APIError) as e:
        parse_body(body(model="m", messages=[{"role": "root", "content": "hi"}]), ChatCompletionRequest)
    assert e.value.status == 400 and e.value.param.startswith("messages") and "user" in e.value.message
    ok = [{"role": r, "content": "x"} for r in ("system", "developer", "user", "assistant", "tool")]
    assert len(parse_body(body(model="m", messages=ok), ChatCompletionRequest).messages) == 5


def test_error_body_shape():
    written = json.loads(error_response("m", "t", "p", "c").to_json())
    assert written == {"error": {"message": "m", "type": "t", "param": "p", "code": "c"}}
    # param and code are always written, null when there is none (OpenAI's shape)
    assert json.loads(error_response("m", "t").to_json()) == {
        "error": {"message": "m", "type": "t", "param": None, "code": None}
    }


def test_serve_config_defaults_and_engine_config():
    cfg = ServeConfig()
    assert (cfg.host, cfg.port, cfg.model_name) == ("127.0.0.1", 8000, "demo")
    ec = cfg.with_overrides(device="cpu").engine_config("prefill", "/m")
    assert ec.model == "/m" and ec.cache.block_size == 128 and ec.device == "cpu"


def test_block_size_defaults_to_the_devices_and_a_given_one_is_kept():
    """128-token blocks on a CPU, 16 on a GPU, fixed at validation (every process hashes prefixes alike); the
    default follows a device override, a block size the config gave does not change."""
    cpu = parse_serve_config({"device": "cpu"})
    assert cpu.block_size == 128 and cpu.engine_config("decode", "/m").cache.block_size == 128
    gpu = cpu.with_overrides(device="cuda")
    assert gpu.block_size == 16 and gpu.engine_config("decode", "/m").cache.block_size == 16
    given = parse_serve_config({"device": "cpu", "block_size": 32}).with_overrides(device="cuda")
    assert given.block_size == 32 and given.engine_config("decode", "/m").cache.block_size == 32
    assert EngineConfig.build("/m", device="cpu").cache.block_size == 128
    assert EngineConfig.build("/m", device="cuda:1").cache.block_size == 16
    assert EngineConfig.build("/m", device="cpu", block_size=16).cache.block_size == 16


def test_serve_config_errors_name_the_field(tmp_path):
    with pytest.raises(ConfigError) as e:
        parse_serve_config({"decode": {"num_replicas": 0}})
    assert "decode.num_replicas" in str(e.value)
    with pytest.raises(ConfigError):
        parse_serve_config({"block_size": 12})
    with pytest.raises(ConfigError):
        parse_serve_config({"nonsense": 1})
    f = tmp_path / "c.yaml"
    f.write_text("shapeserve:\n  port: 9000\n  classifier:\n    local_max_uncached_tokens: 8\n")
    cfg = load_serve_config(f)
    assert cfg.port == 9000 and cfg.classifier.local_max_uncached_tokens == 8
