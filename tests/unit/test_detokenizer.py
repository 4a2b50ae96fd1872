"""Incremental detokenization never splits a multi-byte character and equals a full decode."""

from transformers import AutoTokenizer

from cluster.engine.detokenizer import IncrementalDetokenizer


def test_streamed_text_equals_full_decode_and_never_shows_broken_chars(demo_model):
    tok = AutoTokenizer.from_pretrained(demo_model)
    text = "Straße 日本語のテキスト 🙂🚀 café naïve"
    ids = tok(text).input_ids
    # the byte-level tokenizer splits these characters across tokens
    assert any("\ufffd" in tok.decode([i]) for i in ids)
    detok = IncrementalDetokenizer(tok, prompt_token_ids=[5, 6])
    pieces = [detok.push([i]) for i in ids]
    pieces.append(detok.flush())
    assert all("\ufffd" not in p for p in pieces)
    assert "".join(pieces) == text == detok.text


def test_flush_emits_an_incomplete_tail(demo_model):
    tok = AutoTokenizer.from_pretrained(demo_model)
    ids = tok("🙂").input_ids
    assert len(ids) > 1
    detok = IncrementalDetokenizer(tok, prompt_token_ids=[])
    assert detok.push(ids[:1]) == ""
    assert detok.flush() == tok.decode(ids[:1])
