"""Byte-level detokenization by table (cluster/byte_level.py) against the tokenizer's own decode."""

from __future__ import annotations

import random

import pytest
from tokenizers import Tokenizer as HFTokenizer
from tokenizers import decoders, models, pre_tokenizers

from mtpserve.cluster.byte_level import ByteStream, byte_table
from mtpserve.cluster.tokenizer import IncrementalDetokenizer, Tokenizer
from mtpserve.cluster.engine_config import DEFAULT_MODEL_DIR
from mtpserve.cluster.output_processor import OutputProcessor
from mtpserve.cluster.request import Request
from mtpserve.sampling_params import SamplingParams

TEXT = "def f(n):\n    return n * 2  # héllo wörld, 日本語 and an emoji 😀 split across byte tokens\n\tend"


@pytest.fixture(scope="module")
def tok() -> Tokenizer:
    return Tokenizer.from_checkpoint(DEFAULT_MODEL_DIR)


def stream(detok: IncrementalDetokenizer, ids: list[int], seed: int) -> str:
    """The text pushed in random chunks of 1..5 ids, as a step's accepted tokens arrive."""
    rng, out, i = random.Random(seed), [], 0
    while i < len(ids):
        n = rng.randint(1, 5)
        out.append(detok.push(ids[i : i + n]))
        i += n
    return "".join(out)


def test_the_default_tokenizer_is_byte_level_and_its_table_spells_every_token(tok: Tokenizer) -> None:
    table = tok.byte_table
    assert table is not None and len(table) == tok._tok.get_vocab_size(with_added_tokens=True)
    ids = tok.encode(TEXT, add_special_tokens=False)
    assert b"".join(table[i] for i in ids).decode() == tok.decode(ids) == TEXT


@pytest.mark.parametrize("seed", range(4))
def test_streamed_text_is_the_tokenizers_and_the_window_paths(tok: Tokenizer, seed: int) -> None:
    ids = tok.encode(TEXT, add_special_tokens=False)
    prompt = tok.encode("print(", add_special_tokens=False)
    by_table = IncrementalDetokenizer(tok, prompt)
    by_window = IncrementalDetokenizer(tok, prompt)
    by_window.bytes = None  # the path tokenizers without a byte table take
    assert by_table.bytes is not None
    assert stream(by_table, ids, seed) == stream(by_window, ids, seed) == TEXT


def test_a_character_split_across_tokens_is_held_until_it_is_whole(tok: Tokenizer) -> None:
    table = tok.byte_table
    emoji = "😀".encode()
    # Ids whose bytes are single bytes of the emoji (the byte-level alphabet has one for each of the 256 bytes).
    single = {b: i for i, b in enumerate(table) if len(b) == 1}
    ids = [single[bytes([b])] for b in emoji]
    s = ByteStream(table)
    assert [s.push([i]) for i in ids] == ["", "", "", "😀"]


def test_special_and_unknown_ids_add_no_text(tok: Tokenizer) -> None:
    eos = tok._tok.token_to_id("<|endoftext|>")
    ids = tok.encode("ok then", add_special_tokens=False)
    s = ByteStream(tok.byte_table)
    assert s.push([eos, ids[0], 10**9, -1, *ids[1:]]) == tok.decode([eos, *ids]) == "ok then"


def test_a_tokenizer_that_is_not_byte_level_has_no_table_and_still_streams(tmp_path) -> None:
    vocab = {"[UNK]": 0, "he": 1, "llo": 2, "▁wor": 3, "ld": 4}
    hf = HFTokenizer(models.WordPiece(vocab, unk_token="[UNK]"))
    hf.pre_tokenizer = pre_tokenizers.Whitespace()
    hf.decoder = decoders.Metaspace()
    assert byte_table(hf) is None
    hf.save(str(tmp_path / "tokenizer.json"))
    tok = Tokenizer.from_checkpoint(tmp_path)
    detok = IncrementalDetokenizer(tok, [])
    assert tok.byte_table is None and detok.bytes is None
    assert detok.push([1, 2]) + detok.push([3, 4]) == tok.decode([1, 2, 3, 4])


def test_a_piece_outside_the_byte_alphabet_leaves_decoding_to_the_tokenizer() -> None:
    hf = HFTokenizer(models.BPE({"a": 0, "b": 1, "ab": 2, "日": 3}, [("a", "b")]))
    hf.decoder = decoders.ByteLevel()
    assert byte_table(hf) is None  # "日" is no byte's stand-in: the table could not spell it
    hf_ok = HFTokenizer(models.BPE({"a": 0, "b": 1, "ab": 2, "Ġ": 3}, [("a", "b")]))
    hf_ok.decoder = decoders.ByteLevel()
    assert byte_table(hf_ok) == [b"a", b"b", b"ab", b" "]


def test_bytes_that_can_never_make_a_character_pass_as_replacements_at_once(tok: Tokenizer) -> None:
    single = {b: i for i, b in enumerate(tok.byte_table) if len(b) == 1}
    s = ByteStream(tok.byte_table)
    stray = single[b"\x80"]  # a continuation byte with no lead byte before it
    assert [s.push([stray]) for _ in range(3)] == ["\ufffd"] * 3 and s.pending == b""
    assert s.push([single[b"\xe6"]]) == "" and s.pending == b"\xe6"  # the lead byte of a 3-byte character waits
    assert s.push([single[b"a"]]) == "\ufffda"  # cut short by an ASCII byte: replaced, and the rest goes on
    ids = tok.encode("日本", add_special_tokens=False)
    assert "".join(s.push([i]) for i in ids) == "日本" and s.pending == b""


@pytest.mark.parametrize("path", ["table", "window"])
def test_a_request_cut_short_inside_a_character_ends_with_a_replacement(tok: Tokenizer, path: str) -> None:
    single = {b: i for i, b in enumerate(tok.byte_table) if len(b) == 1}
    ids = tok.encode("ok ", add_special_tokens=False) + [single[b] for b in (b"\xf0", b"\x9f")]  # half an emoji
    processor = OutputProcessor(tok)
    req = Request("r", [1, 2, 3], 3, SamplingParams(max_tokens=len(ids)), 0, 0, (), 64, 0.0)
    processor.add(req)
    if path == "window":
        processor._text["r"].detok.bytes = None
    texts = [processor.process(req, ids[:-1], None).new_text]
    req.finish_reason = "length"
    texts.append(processor.process(req, ids[-1:], None).new_text)
    assert "".join(texts) == tok.decode(ids) == "ok \ufffd"
    assert texts[0] == ("ok " if path == "table" else "")  # the window path holds its whole window back
