"""The checkpoint's tokenizer.json, and incremental detokenization for streaming."""

from __future__ import annotations

from pathlib import Path

from tokenizers import Tokenizer as HFTokenizer

from mtpserve.cluster.byte_level import ByteStream, byte_table


class Tokenizer:
    def __init__(self, path: str | Path) -> None:
        self._tok = HFTokenizer.from_file(str(path))
        # Each id's bytes where the tokenizer is byte-level (byte_level.py), else None: built here, at the engine's
        # start (on the 2-core CPU 40 ms for the default model's 8192 ids, 0.6 s for 128k), not on the first request.
        self.byte_table: list[bytes] | None = byte_table(self._tok)

    @staticmethod
    def from_checkpoint(checkpoint: str | Path) -> "Tokenizer | None":
        path = Path(checkpoint) / "tokenizer.json"
        return Tokenizer(path) if path.is_file() else None

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return self._tok.encode(text, add_special_tokens=add_special_tokens).ids

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        return self._tok.decode(ids, skip_special_tokens=skip_special_tokens)


class IncrementalDetokenizer:
    """Emits text as tokens arrive, holding back incomplete UTF-8 sequences.

    A byte-level tokenizer's ids are looked up in its byte table (ByteStream), with no call into the tokenizer.
    Others decode a short window (`prefix` .. end) instead of the whole output, which keeps each step cheap, and
    decode it with and without the new tokens, which keeps word-boundary spaces right.
    """

    def __init__(self, tokenizer: Tokenizer, prompt_ids: list[int]) -> None:
        self.tok = tokenizer
        table = tokenizer.byte_table
        self.bytes = ByteStream(table) if table is not None else None
        self.ids = list(prompt_ids[-6:])  # context so the first output token decodes with its leading space
        self.prefix = 0
        self.read = len(self.ids)

    def push(self, new_ids: list[int]) -> str:
        if self.bytes is not None:
            return self.bytes.push(new_ids)
        self.ids += new_ids
        before, after = self._window()
        if after.endswith("\ufffd") or len(after) <= len(before):
            return ""  # wait for the rest of a multi-byte character
        self.prefix, self.read = self.read, len(self.ids)
        return after[len(before) :]

    def flush(self) -> str:
        """The text still held back once the request ends (U+FFFD for a character its last tokens cut short), as the
        tokenizer decodes the whole output."""
        if self.bytes is not None:
            return self.bytes.flush()
        before, after = self._window()
        self.prefix = self.read = len(self.ids)
        return after[len(before) :]

    def _window(self) -> tuple[str, str]:
        """The window's text without the tokens not yet emitted, and with them."""
        return self.tok.decode(self.ids[self.prefix : self.read]), self.tok.decode(self.ids[self.prefix :])
