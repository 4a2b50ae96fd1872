"""Prompt -> token ids, shared by the HTTP router and the offline batch runner.

One place decides how text is tokenized and how a chat is rendered, so the server and
``shapeserve run-batch`` feed the engine identical tokens for identical requests.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from cluster.errors import InvalidRequestError


def _check_unicode(text: str, param: str) -> None:
    """JSON can carry lone surrogates (``"\\ud800"``) that are not text; the tokenizer cannot take them."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as e:
        bad = text[e.start : e.end].encode("unicode_escape").decode()
        raise InvalidRequestError(
            f"{param} contains {bad} at character {e.start}, a lone UTF-16 surrogate that is not valid "
            "Unicode; send well-formed text",
            param,
        ) from None


def encode_prompt(tokenizer, prompt: str | list[int], add_special_tokens: bool = True) -> list[int]:
    """Text is tokenized with the tokenizer's own special tokens (e.g. BOS); a list of ids passes through."""
    if isinstance(prompt, str):
        _check_unicode(prompt, "prompt")
        return list(tokenizer(prompt, add_special_tokens=add_special_tokens).input_ids)
    if not all(isinstance(t, int) and not isinstance(t, bool) for t in prompt):
        raise InvalidRequestError("prompt must be a string or a list of integer token ids", "prompt")
    return list(prompt)


def encode_chat(
    tokenizer,
    messages: list[dict[str, Any]],
    add_generation_prompt: bool = True,
    tools: list[dict[str, Any]] | None = None,
) -> list[int]:
    """Renders ``messages`` (and ``tools``, for templates that list them) with the tokenizer's chat template; a
    clear error when the model has none."""
    for m in messages:
        _check_unicode(m.get("content") or "", "messages")
    if not getattr(tokenizer, "chat_template", None):
        raise InvalidRequestError(
            "this model's tokenizer has no chat template, so /v1/chat/completions cannot render "
            "the conversation; use /v1/completions with a plain prompt, or add a chat_template to "
            "the model's tokenizer_config.json",
            "messages",
        )
    try:
        text = tokenizer.apply_chat_template(
            messages, tools=tools, tokenize=False, add_generation_prompt=add_generation_prompt
        )
    except Exception as e:  # jinja errors: the template rejected these messages
        raise InvalidRequestError(f"the chat template rejected these messages: {e}", "messages") from e
    _check_unicode(text, "messages")
    # The template already spells out special tokens; do not add BOS twice.
    return list(tokenizer(text, add_special_tokens=False).input_ids)


def check_prompt(prompt_token_ids: Sequence[int], max_tokens: int, vocab_size: int, max_model_len: int) -> None:
    """The rule every entry point applies to a tokenized prompt (the HTTP edge, run-batch, the engine itself):
    not empty, every id in the vocabulary, and room for ``max_tokens`` in the context. Raises InvalidRequestError."""
    n = len(prompt_token_ids)
    if n == 0:
        raise InvalidRequestError("the prompt is empty; send at least one token", "prompt")
    bad = next((t for t in prompt_token_ids if not isinstance(t, int) or not 0 <= t < vocab_size), None)
    if bad is not None:
        raise InvalidRequestError(f"token id {bad!r} is outside the vocabulary [0, {vocab_size})", "prompt")
    if n + max_tokens > max_model_len:
        raise InvalidRequestError(
            f"this model's context is {max_model_len} tokens, but the prompt has {n} tokens and max_tokens is "
            f"{max_tokens} ({n + max_tokens} in total); shorten the prompt or lower max_tokens",
            "max_tokens" if n < max_model_len else "prompt",
            "context_length_exceeded",
        )


def max_chars_per_token(tokenizer) -> int:
    """The most characters one token of this vocabulary stands for (byte-level and SentencePiece vocabularies
    spell each byte with at least one character, so this bounds the text of any token)."""
    return max((len(t) for t in tokenizer.get_vocab()), default=1) or 1


def check_text_fits(num_chars: int, chars_per_token: int, max_model_len: int, param: str) -> None:
    """Refuses, before tokenizing, text that cannot fit the context even at the most characters per token
    (a margin of 2x covers normalizers that drop characters)."""
    least_tokens = num_chars // (2 * chars_per_token)
    if least_tokens >= max_model_len:
        raise InvalidRequestError(
            f"the {param} has {num_chars} characters, which is at least {least_tokens} tokens, but the model's "
            f"context is {max_model_len} tokens; shorten the {param}",
            param,
        )
