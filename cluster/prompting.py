"""Prompt -> token ids, shared by the HTTP router and the offline batch runner.

One place decides how text is tokenized and how a chat is rendered, so the server and
``shapeserve run-batch`` feed the engine identical tokens for identical requests.
"""

from __future__ import annotations

from cluster.errors import InvalidRequestError


def encode_prompt(tokenizer, prompt: str | list[int]) -> list[int]:
    """Text is tokenized with the tokenizer's own special tokens (e.g. BOS); a list of ids passes through."""
    if isinstance(prompt, str):
        return list(tokenizer(prompt).input_ids)
    if not all(isinstance(t, int) and not isinstance(t, bool) for t in prompt):
        raise InvalidRequestError("prompt must be a string or a list of integer token ids", "prompt")
    return list(prompt)


def encode_chat(tokenizer, messages: list[dict[str, str]], add_generation_prompt: bool = True) -> list[int]:
    """Renders ``messages`` with the tokenizer's chat template; a clear error when the model has none."""
    if not getattr(tokenizer, "chat_template", None):
        raise InvalidRequestError(
            "this model's tokenizer has no chat template, so /v1/chat/completions cannot render "
            "the conversation; use /v1/completions with a plain prompt, or add a chat_template to "
            "the model's tokenizer_config.json",
            "messages",
        )
    try:
        text = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=add_generation_prompt)
    except Exception as e:  # jinja errors: the template rejected these messages
        raise InvalidRequestError(f"the chat template rejected these messages: {e}", "messages") from e
    # The template already spells out special tokens; do not add BOS twice.
    return list(tokenizer(text, add_special_tokens=False).input_ids)
