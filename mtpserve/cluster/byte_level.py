"""Byte-level detokenization by table: each token's bytes looked up, the stream's bytes decoded as UTF-8.

A byte-level BPE tokenizer (GPT-2's byte alphabet: Llama 3, Qwen, DeepSeek and the default model) spells every
token as a fixed byte string, so the text of any run of ids is their bytes joined and decoded. Streaming then needs
no call into the tokenizer: two `decode` calls a request and step took about a fifth of the host's step at c = 256
(H200, runs 337-338). The table is built from the tokenizer's vocabulary and kept only if it decodes every token the
way the tokenizer does; otherwise (another decoder, a piece outside the alphabet that is not an added token) the
caller decodes through the tokenizer.
"""

from __future__ import annotations

import json

from tokenizers import Tokenizer as HFTokenizer


def _byte_of_char() -> dict[str, int]:
    """GPT-2's alphabet inverted: the printable character that stands for each byte -> the byte."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    chars, extra = {}, 0
    for b in range(256):
        if b in printable:
            chars[chr(b)] = b
        else:  # bytes without a printable stand-in take code points from 256 on, in byte order
            chars[chr(256 + extra)] = b
            extra += 1
    return chars


def byte_table(tok: HFTokenizer, skip_special_tokens: bool = True) -> list[bytes] | None:
    """bytes of every id (b"" for ids without a token, and for special tokens when they are skipped), or None
    where the tokenizer is not byte-level or the table would decode some token differently from it."""
    spec = json.loads(tok.to_str())
    if (spec.get("decoder") or {}).get("type") != "ByteLevel":
        return None
    added = {t["id"]: t for t in spec.get("added_tokens", [])}
    byte_of = _byte_of_char()
    vocab = tok.get_vocab(with_added_tokens=True)
    table = [b""] * (max(vocab.values(), default=-1) + 1)
    for piece, i in vocab.items():
        if i in added:  # an added token's text is its content (or nothing, where it is special and skipped)
            table[i] = b"" if added[i].get("special") and skip_special_tokens else added[i]["content"].encode()
        elif all(c in byte_of for c in piece):
            table[i] = bytes(byte_of[c] for c in piece)
        else:
            return None
    return table if _agrees(tok, table, sorted(vocab.values()), skip_special_tokens) else None


def _agrees(tok: HFTokenizer, table: list[bytes], ids: list[int], skip_special_tokens: bool) -> bool:
    """Every token whose bytes are whole UTF-8 decodes alone to the table's text (a token that is part of a
    character has no text of its own to compare: the decoder would replace it)."""
    ids = [i for i in ids if _is_text(table[i])]
    texts = tok.decode_batch([[i] for i in ids], skip_special_tokens=skip_special_tokens)
    return all(table[i].decode() == text for i, text in zip(ids, texts))


def _is_text(b: bytes) -> bool:
    try:
        b.decode()
    except UnicodeDecodeError:
        return False
    return True


class ByteStream:
    """The text of a stream of ids, as whole characters: the bytes of a character still incomplete are held back.
    Those are at most the last three, a lead byte and what followed it, short of the length the lead byte names; all
    other bytes are decoded at once (where they make no character, as U+FFFD), so nothing waits for good and no step
    decodes more than its new bytes and the few held back; `flush` passes them on when the request ends."""

    def __init__(self, table: list[bytes]) -> None:
        self.table, self.pending = table, b""

    def push(self, new_ids: list[int]) -> str:
        """The text the new ids complete ("" while the bytes so far end inside a character)."""
        table, n = self.table, len(self.table)
        data = self.pending + b"".join([table[i] if 0 <= i < n else b"" for i in new_ids])
        whole = len(data) - _incomplete_tail(data)
        self.pending = data[whole:]
        return data[:whole].decode("utf-8", "replace")

    def flush(self) -> str:
        """The bytes still held, as text (U+FFFD for a character cut short): the stream has ended."""
        text, self.pending = self.pending.decode("utf-8", "replace"), b""
        return text


def _incomplete_tail(data: bytes) -> int:
    """Trailing bytes that begin a multi-byte UTF-8 character still short of its length (0 to 3)."""
    for back in range(1, min(4, len(data)) + 1):
        byte = data[-back]
        if byte & 0xC0 != 0x80:  # the last byte that is no continuation byte: ASCII or a lead byte
            length = 2 if byte & 0xE0 == 0xC0 else 3 if byte & 0xF0 == 0xE0 else 4 if byte & 0xF8 == 0xF0 else 1
            return back if back < length else 0
    return 0
