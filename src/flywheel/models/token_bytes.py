"""Each token's own bytes, for OpenAI logprobs (`bytes`, and the `token` string made from them).

A token is a piece of the text's UTF-8, not necessarily whole characters: decoding one
token alone gives U+FFFD for a byte inside a multi-byte character, so the bytes are read
from the vocabulary instead:
  - byte-level BPE (GPT-2, Qwen, Llama 3; the tiny model): the token string spells its bytes
    in the ByteLevel alphabet (GPT-2's `bytes_to_unicode`), mapped back here;
  - SentencePiece style (a `ByteFallback` / `Metaspace` decoder, or a slow tokenizer with an
    `sp_model`): `<0xNN>` is byte NN, `▁` a space, the rest is UTF-8 text;
  - added tokens (special or not): the UTF-8 of their content;
  - anything else: the UTF-8 of the token decoded alone.
Ids without a token (the model's vocabulary padding past the tokenizer's) have None.
Concatenating the bytes of a completion's tokens (special tokens left out) gives the UTF-8
of its text for byte-level vocabularies (tested); a decoder that edits text (a SentencePiece
one stripping the first space, `clean_up_tokenization_spaces`) makes the text differ from the
bytes by those edits. The table is built once per tokenizer and cached.

`token_text` names a token as OpenAI does: its text when its bytes are valid UTF-8, else
`bytes:\\xNN...` (a literal backslash, x and two hex digits per byte).
"""

from __future__ import annotations

import json
import threading
import weakref
from dataclasses import dataclass

_cache: "weakref.WeakKeyDictionary[object, TokenTable]" = weakref.WeakKeyDictionary()
_lock = threading.Lock()


@dataclass(frozen=True)
class TokenTable:
    """By token id: its bytes (None: no such token) and whether it is special (left out of
    the decoded text)."""

    raw: tuple[bytes | None, ...]
    special: frozenset[int]

    def bytes_of(self, token_id: int) -> bytes | None:
        return self.raw[token_id] if 0 <= token_id < len(self.raw) else None

    def text_bytes(self, token_id: int) -> int:
        """How many bytes of the decoded text (special tokens skipped) the token makes."""
        b = self.bytes_of(token_id)
        return 0 if b is None or token_id in self.special else len(b)


def token_text(raw: bytes) -> str:
    """OpenAI's `token` string for a token's bytes."""
    try:
        return raw.decode("utf-8")
    except UnicodeDecodeError:
        return "bytes:" + "".join(f"\\x{b:02x}" for b in raw)


def token_table(tokenizer) -> TokenTable:
    """The (cached) table of `tokenizer`."""
    with _lock:
        table = _cache.get(tokenizer)
    if table is None:
        table = build_table(tokenizer)
        with _lock:
            _cache[tokenizer] = table
    return table


def bytes_to_unicode() -> dict[int, str]:
    """GPT-2's reversible byte -> printable-character map (the ByteLevel alphabet)."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    out, extra = {}, 0
    for b in range(256):
        if b in printable:
            out[b] = chr(b)
        else:
            out[b] = chr(256 + extra)
            extra += 1
    return out


def build_table(tokenizer) -> TokenTable:
    n = len(tokenizer)
    pieces = tokenizer.convert_ids_to_tokens(list(range(n)))  # (n,) vocabulary strings, None for holes
    added = {i: (t.content, bool(t.special)) for i, t in getattr(tokenizer, "added_tokens_decoder", {}).items()}
    special = frozenset(i for i, (_, s) in added.items() if s) | frozenset(getattr(tokenizer, "all_special_ids", ()))
    scheme = _scheme(tokenizer)
    unbyte = {c: b for b, c in bytes_to_unicode().items()}
    raw: list[bytes | None] = []
    for i, piece in enumerate(pieces):
        if i in added:
            raw.append(added[i][0].encode("utf-8"))
        elif piece is None:
            raw.append(None)
        elif scheme == "bytelevel" and all(c in unbyte for c in piece):
            raw.append(bytes(unbyte[c] for c in piece))
        elif scheme == "sentencepiece":
            raw.append(_sentencepiece_bytes(piece))
        else:
            raw.append(tokenizer.decode([i], skip_special_tokens=False).encode("utf-8"))
    return TokenTable(tuple(raw), special)


def _scheme(tokenizer) -> str:
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is not None and backend.decoder is not None:
        spec = json.dumps(json.loads(backend.decoder.__getstate__()))
        if '"ByteLevel"' in spec:
            return "bytelevel"
        if '"ByteFallback"' in spec or '"Metaspace"' in spec or "\u2581" in spec or "\\u2581" in spec:
            return "sentencepiece"
        return "other"
    if getattr(tokenizer, "byte_decoder", None) is not None:  # a slow GPT-2 style tokenizer
        return "bytelevel"
    if getattr(tokenizer, "sp_model", None) is not None:
        return "sentencepiece"
    return "other"


def _sentencepiece_bytes(piece: str) -> bytes:
    if len(piece) == 6 and piece.startswith("<0x") and piece.endswith(">"):
        try:
            return bytes([int(piece[3:5], 16)])
        except ValueError:
            pass
    return piece.replace("\u2581", " ").encode("utf-8")
