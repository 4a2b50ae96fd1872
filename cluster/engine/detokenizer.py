"""Incremental detokenization that never emits half of a multi-byte character.

Decoding token by token breaks characters that span tokens (byte-level BPE splits UTF-8
bytes) and drops the spaces that SentencePiece tokenizers attach to the next token. So
each step decodes a short window - a few tokens already emitted (context) plus the new
ones - and emits only the text past the context, holding it back while it ends in an
incomplete character (U+FFFD).
"""

from __future__ import annotations

_CONTEXT_TOKENS = 5


class IncrementalDetokenizer:
    def __init__(self, tokenizer, prompt_token_ids: list[int], skip_special_tokens: bool = True):
        self.tokenizer = tokenizer
        self.skip_special_tokens = skip_special_tokens
        self.ids: list[int] = list(prompt_token_ids[-_CONTEXT_TOKENS:])
        self.prefix_offset = 0  # start of the decode window
        self.read_offset = len(self.ids)  # tokens before this are already emitted
        self.text = ""
        #: Characters of ``text`` already handed to the caller (the engine holds some back for stop strings).
        self.emitted = 0

    def _decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=self.skip_special_tokens)

    def push(self, token_ids: list[int]) -> str:
        """Adds tokens and returns the newly complete text (possibly empty)."""
        self.ids.extend(token_ids)
        prefix_text = self._decode(self.ids[self.prefix_offset : self.read_offset])
        new_text = self._decode(self.ids[self.prefix_offset :])
        if len(new_text) <= len(prefix_text) or new_text.endswith("\ufffd"):
            return ""
        delta = new_text[len(prefix_text) :]
        self.prefix_offset = max(self.read_offset - _CONTEXT_TOKENS, 0)
        self.read_offset = len(self.ids)
        self.text += delta
        return delta

    def flush(self) -> str:
        """At the end of a request: whatever is still held back, incomplete characters included."""
        prefix_text = self._decode(self.ids[self.prefix_offset : self.read_offset])
        new_text = self._decode(self.ids[self.prefix_offset :])
        self.read_offset = len(self.ids)
        delta = new_text[len(prefix_text) :] if len(new_text) > len(prefix_text) else ""
        self.text += delta
        return delta
