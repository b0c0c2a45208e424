"""A byte-level tokenizer: one token per UTF-8 byte.

The served model has random weights and no trained vocabulary, so any text must map to
tokens and back without loss: UTF-8 bytes do that with no table to ship.  The model is built
with a vocabulary of exactly 256, so every sampled token is a byte too; random bytes need not
form valid UTF-8, and invalid sequences decode to U+FFFD.
"""

from __future__ import annotations

import codecs
from collections.abc import Iterable, Sequence
from typing import Final

VOCAB_SIZE: Final = 256

ROLES: Final = ("system", "user", "assistant")
"""Chat roles the template knows."""


def encode(text: str) -> tuple[int, ...]:
    """The token ids of `text` (raises UnicodeEncodeError on lone surrogates)."""
    return tuple(text.encode("utf-8"))


def decode(tokens: Sequence[int]) -> str:
    return bytes(tokens).decode("utf-8", errors="replace")


class StreamDecoder:
    """Decodes tokens as they arrive: a character split over several tokens comes out whole
    once its last byte is in, and the text streamed equals :func:`decode` of all tokens."""

    def __init__(self) -> None:
        self._decoder = codecs.getincrementaldecoder("utf-8")(errors="replace")

    def feed(self, tokens: Iterable[int]) -> str:
        return self._decoder.decode(bytes(tokens))

    def flush(self) -> str:
        return self._decoder.decode(b"", final=True)


def chat_prompt(messages: Sequence[tuple[str, str]]) -> str:
    """The prompt text of a conversation ((role, content) pairs), ending where the
    assistant's answer begins.  Each message is one line group, so a conversation that grows
    shares its whole earlier text (and its cached blocks) with the turns before."""
    parts = [f"<|{role}|>\n{content}\n" for role, content in messages]
    parts.append("<|assistant|>\n")
    return "".join(parts)
