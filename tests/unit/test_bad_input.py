"""Bad input gets a clear error naming the problem; nothing already accepted is disturbed."""

import json

import pytest

from cluster.config import CacheConfig, EngineConfig, SamplingParams
from cluster.engine.host_memory import available_memory_bytes
from cluster.engine.llm_engine import LLMEngine
from cluster.errors import ConfigError, InvalidRequestError, ModelLoadError
from cluster.tokenizer import load_tokenizer
from cluster.tools.cli import main as cli_main
from tests.helpers import engine_config


def test_unknown_model_dir(tmp_path, capsys):
    with pytest.raises(ModelLoadError, match="does not exist"):
        LLMEngine(EngineConfig(model=str(tmp_path / "nope")))
    code = cli_main(["run-batch", "-i", "x", "-o", "y", "--model", str(tmp_path / "nope")])
    assert code == 2 and "does not exist" in capsys.readouterr().err


def test_unsupported_architecture(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({"architectures": ["GPT2LMHeadModel"], "model_type": "gpt2"}))
    with pytest.raises(ModelLoadError, match="unsupported architecture.*GPT2LMHeadModel"):
        LLMEngine(EngineConfig(model=str(tmp_path)))


def test_missing_weights(tmp_path, demo_model):
    (tmp_path / "config.json").write_text((demo_model / "config.json").read_text())
    with pytest.raises(ModelLoadError, match="no \\*.safetensors"):
        LLMEngine(EngineConfig(model=str(tmp_path)))


@pytest.fixture(scope="module")
def engine(demo_model):
    return LLMEngine(engine_config(demo_model, num_blocks=128))


@pytest.mark.parametrize(
    "prompt_len, params, match",
    [
        (2000, SamplingParams(), "context is 1024 tokens, but the prompt has 2000 tokens"),
        (4, SamplingParams(max_tokens=0), "max_tokens must be a positive integer"),
        (4, SamplingParams(max_tokens=-3), "max_tokens must be a positive integer"),
        (4, SamplingParams(top_p=0.0), r"top_p must be in \(0, 1\]"),
        (4, SamplingParams(top_p=1.5), r"top_p must be in \(0, 1\]"),
        (4, SamplingParams(temperature=-1.0), "temperature must be in"),
        (0, SamplingParams(), "prompt is empty"),
        # run-batch and other direct callers get the edge's check: a stop id the model cannot sample stops nothing
        (4, SamplingParams(stop_token_ids=(2, 512)), r"stop_token_ids\[1\] is 512, outside the vocabulary \[0, 512\)"),
    ],
)
def test_bad_requests_are_refused_and_running_ones_continue(engine, prompt_len, params, match):
    engine.add_request("running", [5, 6, 7], SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True))
    with pytest.raises(InvalidRequestError, match=match):
        engine.add_request("bad", list(range(4, 4 + prompt_len)) if prompt_len < 500 else [5] * prompt_len, params)
    outs = []
    while engine.has_unfinished_requests():
        outs += engine.step()
    assert [o.request_id for o in outs] == ["running"] * 4 and outs[-1].finished
    engine.block_pool.check_integrity()
    assert engine.block_pool.num_used_blocks == 0


def test_token_id_outside_vocab(engine):
    with pytest.raises(InvalidRequestError, match="token id 99999 is outside the vocabulary"):
        engine.add_request("x", [5, 99999], SamplingParams())


def test_request_larger_than_the_pool(demo_model):
    small = LLMEngine(engine_config(demo_model, num_blocks=4))
    with pytest.raises(InvalidRequestError, match="needs 7 KV blocks but this worker's pool has 4"):
        small.add_request("x", [5] * 100, SamplingParams(max_tokens=10))


def test_a_kv_pool_larger_than_the_hosts_memory_is_refused(demo_model, tmp_path, capsys):
    """Refused before any of it is allocated, with what to lower; backing it failed with a bare ENOMEM (or, just
    under the host's limit, woke the OOM killer)."""
    too_much_gb = available_memory_bytes() / 2**30 * 2 + 1
    expected = r"the KV cache takes .* GiB \(this engine: 1 x .* GiB .*\) but this host has .* GiB of memory available"
    with pytest.raises(ConfigError, match=expected):
        LLMEngine(EngineConfig(model=str(demo_model), cache=CacheConfig(kv_cache_memory_gb=too_much_gb)))
    (tmp_path / "in.jsonl").write_text("")
    args = [
        "run-batch",
        "-i",
        str(tmp_path / "in.jsonl"),
        "-o",
        str(tmp_path / "out.jsonl"),
        "--model",
        str(demo_model),
    ]
    assert cli_main([*args, "--kv-cache-memory-gb", str(too_much_gb)]) == 2
    assert "lower kv_cache_memory_gb" in capsys.readouterr().err


def test_bad_engine_config(demo_model):
    with pytest.raises(ConfigError, match="dtype 'float64' is not supported"):
        EngineConfig(model=str(demo_model), dtype="float64").validate()
    with pytest.raises(ConfigError, match="block_size must be a power of two"):
        engine_config(demo_model, block_size=12).validate()


def test_run_batch_bad_lines_get_error_records(demo_model, tmp_path, capsys):
    lines = [
        "{not json",
        json.dumps({"custom_id": "long", "url": "/v1/completions", "method": "POST", "body": {"prompt": [5] * 2000}}),
        json.dumps(
            {"custom_id": "ok", "url": "/v1/completions", "method": "POST", "body": {"prompt": "hi", "max_tokens": 3}}
        ),
        json.dumps({"custom_id": "nobody", "url": "/v1/completions", "method": "POST"}),
        json.dumps(
            {"custom_id": "chat-missing", "url": "/v1/chat/completions", "method": "POST", "body": {"max_tokens": 3}}
        ),
        # the same checks as the server: a model this run does not serve, a logit_bias token outside the
        # vocabulary, max_tokens past the context (never clipped)
        json.dumps({"custom_id": "other-model", "url": "/v1/completions", "body": {"model": "gpt-4", "prompt": "hi"}}),
        json.dumps({"custom_id": "bias", "url": "/v1/completions", "body": {"prompt": "hi", "logit_bias": {"900": 9}}}),
        json.dumps({"custom_id": "too-long", "url": "/v1/completions", "body": {"prompt": "hi", "max_tokens": 5000}}),
        json.dumps(
            {"custom_id": "by-dir", "url": "/v1/completions", "body": {"model": str(demo_model), "prompt": "hi"}}
        ),
        json.dumps({"custom_id": "n", "url": "/v1/completions", "body": {"prompt": "hi", "n": 2}}),
    ]
    infile, outfile = tmp_path / "in.jsonl", tmp_path / "out.jsonl"
    infile.write_text("\n".join(lines) + "\n")
    assert (
        cli_main(["run-batch", "-i", str(infile), "-o", str(outfile), "--model", str(demo_model), "--num-blocks", "64"])
        == 0
    )
    recs = [json.loads(x) for x in outfile.read_text().splitlines()]
    ids = [None, "long", "ok", "nobody", "chat-missing", "other-model", "bias", "too-long", "by-dir", "n"]
    assert [r["custom_id"] for r in recs] == ids
    assert [r["response"]["status_code"] for r in recs] == [400, 400, 200, 400, 400, 404, 400, 400, 200, 400]
    assert "one prompt and n=1 per line" in recs[9]["error"]["message"]
    assert "'gpt-4' does not exist" in recs[5]["error"]["message"]
    assert "outside the vocabulary" in recs[6]["error"]["message"]
    assert "max_tokens" in recs[7]["error"]["message"]
    bar = capsys.readouterr().err  # the progress bar: every line done, with the output rate
    assert "run-batch: 100%" in bar and "10/10" in bar and "output tok/s" in bar
    assert "not valid JSON" in recs[0]["error"]["message"]
    assert "context is 1024" in recs[1]["error"]["message"]
    assert "body must be a JSON object" in recs[3]["error"]["message"]
    assert "messages" in recs[4]["error"]["message"]
    assert recs[2]["error"] is None and recs[2]["response"]["body"]["usage"]["completion_tokens"] == 3


def test_run_batch_max_model_len_and_chat_template(demo_model, tmp_path):
    template = tmp_path / "chat.jinja"
    template.write_text("{% for m in messages %}<{{ m.role }}>{{ m.content }}{% endfor %}")
    lines = [
        json.dumps({"custom_id": "long", "url": "/v1/completions", "body": {"prompt": [5] * 60, "max_tokens": 8}}),
        json.dumps({"custom_id": "fits", "url": "/v1/completions", "body": {"prompt": [5] * 50, "max_tokens": 8}}),
        json.dumps(
            {
                "custom_id": "chat",
                "url": "/v1/chat/completions",
                "body": {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2},
            }
        ),
    ]
    infile, outfile = tmp_path / "in.jsonl", tmp_path / "out.jsonl"
    infile.write_text("\n".join(lines) + "\n")
    argv = ["run-batch", "-i", str(infile), "-o", str(outfile), "--model", str(demo_model), "--no-progress"]
    assert cli_main([*argv, "--max-model-len", "64", "--chat-template", str(template)]) == 0
    recs = [json.loads(x) for x in outfile.read_text().splitlines()]
    assert [r["response"]["status_code"] for r in recs] == [400, 200, 200]
    assert "context is 64" in recs[0]["error"]["message"]
    tok = load_tokenizer(str(demo_model))
    want = len(tok("<user>hi", add_special_tokens=False).input_ids)  # rendered with the file's template
    assert recs[2]["response"]["body"]["usage"]["prompt_tokens"] == want


def test_run_batch_echoes_and_scores_prompts_as_the_server_does(demo_model, tmp_path):
    prompt = [5 + (i * 7) % 500 for i in range(20)]
    body = {"prompt": prompt, "max_tokens": 2, "temperature": 0, "echo": True, "logprobs": 2, "prompt_logprobs": 1}
    infile, outfile = tmp_path / "in.jsonl", tmp_path / "out.jsonl"
    infile.write_text(json.dumps({"custom_id": "e", "url": "/v1/completions", "body": body}) + "\n")
    assert cli_main(["run-batch", "-i", str(infile), "-o", str(outfile), "--model", str(demo_model)]) == 0
    choice = json.loads(outfile.read_text())["response"]["body"]["choices"][0]
    engine = LLMEngine(engine_config(demo_model, num_blocks=64))
    params = SamplingParams(max_tokens=2, temperature=0.0, logprobs=True, prompt_logprobs=2)
    scores = engine.generate([prompt], params)[0]["prompt_logprobs"]
    lp = choice["logprobs"]
    assert len(lp["tokens"]) == len(prompt) + 2 and lp["token_logprobs"][0] is None
    assert lp["token_logprobs"][1 : len(prompt)] == pytest.approx([s.logprob for s in scores], abs=1e-5)
    assert len(lp["top_logprobs"][1]) <= 2 and choice["text"].startswith(engine.tokenizer.decode(prompt))
    assert choice["prompt_logprobs"][0] is None and len(choice["prompt_logprobs"]) == len(prompt)
    assert choice["prompt_logprobs"][1][str(prompt[1])]["rank"] == scores[0].rank
