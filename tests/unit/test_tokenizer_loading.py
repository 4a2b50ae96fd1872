"""load_tokenizer gives the tokenizer AutoTokenizer gives, without importing the model's config class (nor, for a
llama directory naming the generic class, AutoTokenizer itself)."""

import json
import re
import shutil
import subprocess
import sys

import pytest
from transformers import AutoTokenizer

from cluster.tokenizer import _is_plain_tokenizers_backend, _plain_config, load_tokenizer
from cluster.tools.demo_model import DemoModelSpec
from tests.conftest import PARITY_SPECS

TEXTS = ["Hello world, this is a test.", "  leading spaces and ünïcödé 123 ", "<s> special </s> inside", ""]


def assert_same_tokenizer(got, want):
    assert type(got) is type(want)
    assert got.get_vocab() == want.get_vocab()
    assert (got.bos_token_id, got.eos_token_id, got.pad_token_id, got.unk_token_id) == (
        want.bos_token_id,
        want.eos_token_id,
        want.pad_token_id,
        want.unk_token_id,
    )
    for text in TEXTS:
        ids = want(text).input_ids
        assert got(text).input_ids == ids
        assert got.decode(ids) == want.decode(ids)
    messages = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hi"}]
    assert got.apply_chat_template(messages, tokenize=False, add_generation_prompt=True) == want.apply_chat_template(
        messages, tokenize=False, add_generation_prompt=True
    )


@pytest.mark.parametrize("spec", sorted(PARITY_SPECS))  # incl. llama3 rope scaling, qwen2: config fields it skips
def test_same_tokenizer_as_auto_tokenizer(model_factory, spec):
    model = model_factory(spec)
    # The demo models name their class: llama loads it directly, qwen2 (whose class transformers overrides)
    # through AutoTokenizer with a plain config.
    assert _is_plain_tokenizers_backend(model) == spec.startswith("llama")
    assert "config" in _plain_config(model)
    assert_same_tokenizer(load_tokenizer(str(model)), AutoTokenizer.from_pretrained(str(model)))


def test_llama3_style_generic_class_name_loads_directly(demo_model, tmp_path):
    copy = tmp_path / "model"
    shutil.copytree(demo_model, copy)
    tokenizer_config = json.loads((copy / "tokenizer_config.json").read_text())
    tokenizer_config["tokenizer_class"] = "PreTrainedTokenizerFast"  # what Llama 3 checkpoints name
    (copy / "tokenizer_config.json").write_text(json.dumps(tokenizer_config))
    assert _is_plain_tokenizers_backend(copy)
    assert_same_tokenizer(load_tokenizer(str(copy)), AutoTokenizer.from_pretrained(str(copy)))


def test_demo_vocabulary_is_filled_with_vocabulary_entries_not_added_tokens(model_factory):
    # A real 32k tokenizer has a handful of added tokens; transformers copies each one when loading.
    tok = load_tokenizer(str(model_factory(DemoModelSpec(vocab_size=2048))))  # more than the corpus trains
    assert len(tok) == 2048
    assert sorted(tok.added_tokens_decoder) == [0, 1, 2, 3]
    assert re.fullmatch(r"(<extra_\d+>){2}", tok.decode([2047, 2046]))
    assert tok("<extra_5>").input_ids != [tok.convert_tokens_to_ids("<extra_5>")]  # no merge produces a filler


def test_a_directory_without_a_named_class_loads_through_auto_config(demo_model, tmp_path):
    copy = tmp_path / "model"
    shutil.copytree(demo_model, copy)
    tokenizer_config = json.loads((copy / "tokenizer_config.json").read_text())
    tokenizer_config.pop("tokenizer_class", None)
    (copy / "tokenizer_config.json").write_text(json.dumps(tokenizer_config))
    assert _plain_config(copy) == {}
    assert_same_tokenizer(load_tokenizer(str(copy)), AutoTokenizer.from_pretrained(str(copy)))


def test_remote_code_keeps_auto_tokenizer_path(demo_model, tmp_path):
    copy = tmp_path / "model"
    shutil.copytree(demo_model, copy)
    tokenizer_config = json.loads((copy / "tokenizer_config.json").read_text())
    tokenizer_config["auto_map"] = {"AutoTokenizer": ["tok.MyTokenizer", None]}
    (copy / "tokenizer_config.json").write_text(json.dumps(tokenizer_config))
    assert _plain_config(copy) == {}
    assert not _is_plain_tokenizers_backend(copy)


def test_loading_does_not_import_the_model_config_class(demo_model):
    # In a fresh interpreter: LlamaConfig's module pulls in torch._dynamo through transformers' kernel
    # integrations, seconds of every replica's start.
    code = (
        "import sys; from cluster.tokenizer import load_tokenizer; load_tokenizer(sys.argv[1]); "
        "print('transformers.models.llama.configuration_llama' in sys.modules, 'torch._dynamo' in sys.modules, "
        "'transformers.models.auto' in sys.modules)"
    )
    out = subprocess.run([sys.executable, "-c", code, str(demo_model)], capture_output=True, text=True, check=True)
    assert out.stdout.split()[-3:] == ["False", "False", "False"], out.stdout + out.stderr
