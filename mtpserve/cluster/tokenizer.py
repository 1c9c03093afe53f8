"""The checkpoint's tokenizer.json, and incremental detokenization for streaming."""

from __future__ import annotations

from pathlib import Path

from tokenizers import Tokenizer as HFTokenizer


class Tokenizer:
    def __init__(self, path: str | Path) -> None:
        self._tok = HFTokenizer.from_file(str(path))

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

    Decoding a short window (`prefix` .. end) instead of the whole output keeps each step cheap,
    and decoding the window with and without the new tokens keeps word-boundary spaces right.
    """

    def __init__(self, tokenizer: Tokenizer, prompt_ids: list[int]) -> None:
        self.tok = tokenizer
        self.ids = list(prompt_ids[-6:])  # context so the first output token decodes with its leading space
        self.prefix = 0
        self.read = len(self.ids)

    def push(self, new_ids: list[int]) -> str:
        self.ids += new_ids
        before = self.tok.decode(self.ids[self.prefix : self.read])
        after = self.tok.decode(self.ids[self.prefix :])
        if after.endswith("\ufffd") or len(after) <= len(before):
            return ""  # wait for the rest of a multi-byte character
        self.prefix, self.read = self.read, len(self.ids)
        return after[len(before) :]
