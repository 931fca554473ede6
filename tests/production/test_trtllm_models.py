"""The trtllm repository's python models (tokenize, detokenize), outside Triton, with a
tiny byte-level BPE tokenizer built offline (the same kind as gpt2-medium's)."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from .conftest import load_model_py

pre = load_model_py("trtllm", "trtllm_preprocessing")
post = load_model_py("trtllm", "trtllm_postprocessing")


@pytest.fixture(scope="module")
def tokenizer(tiny_gpt2: Path):
    return pre.load_tokenizer(str(tiny_gpt2))


def _strings(*rows: list[str]) -> np.ndarray:
    return np.array([[w.encode() for w in row] for row in rows], dtype=object)


def test_prompts_become_padded_ids_with_their_lengths(tokenizer) -> None:
    out = pre.preprocess(tokenizer, 100, _strings(["The cat"], ["A kitten rests on a rug"]))
    short, long_ = tokenizer.encode("The cat"), tokenizer.encode("A kitten rests on a rug")
    assert out["input_ids"].dtype == np.int32
    assert out["input_lengths"].tolist() == [[len(short)], [len(long_)]]
    assert out["input_ids"][0, : len(short)].tolist() == short
    assert out["input_ids"][1].tolist() == long_


def test_end_and_pad_ids_default_to_the_tokenizer_and_requests_can_override(tokenizer) -> None:
    out = pre.preprocess(tokenizer, 100, _strings(["hello"]))
    assert out["out_end_id"].tolist() == [[tokenizer.eos_token_id]]
    assert out["out_pad_id"].tolist() == [[tokenizer.eos_token_id]]
    given = pre.preprocess(tokenizer, 100, _strings(["hello"]), end_id=np.array([[7]], dtype=np.int32))
    assert given["out_end_id"].tolist() == [[7]]


def test_stop_words_use_the_tensorrt_llm_word_list_layout(tokenizer) -> None:
    words = ["cat", " on the mat"]
    out = pre.preprocess(tokenizer, 100, _strings(["x"]), stop_words=_strings([*words, ""]))
    ids = [tokenizer.encode(w, add_special_tokens=False) for w in words]
    flat = ids[0] + ids[1]
    table = out["stop_words_list"]
    assert table.shape == (1, 2, len(flat))
    assert table[0, 0].tolist() == flat
    assert table[0, 1, :2].tolist() == [len(ids[0]), len(flat)]
    assert (table[0, 1, 2:] == -1).all()


def test_no_words_is_a_single_minus_one_offset(tokenizer) -> None:
    out = pre.preprocess(tokenizer, 100, _strings(["x"], ["y"]))
    for name in ("stop_words_list", "bad_words_list"):
        assert out[name].shape == (2, 2, 1)
        assert out[name][:, 1].tolist() == [[-1], [-1]]


def test_too_long_and_empty_prompts_are_refused(tokenizer) -> None:
    with pytest.raises(ValueError, match="at most 3"):
        pre.preprocess(tokenizer, 3, _strings(["Stock markets fell sharply today"]))
    with pytest.raises(ValueError, match="empty"):
        pre.preprocess(tokenizer, 100, _strings([""]))


def test_streamed_pieces_detokenize_to_the_whole_text(tokenizer) -> None:
    text = "The gateway streams each request to the least busy replica"
    ids = tokenizer.encode(text)
    # Streaming: one response per token, each detokenized on its own.
    pieces = [post.detokenize(tokenizer, np.array([[[t]]], dtype=np.int32), np.array([[1]]), True)[0, 0] for t in ids]
    assert b"".join(pieces).decode() == text


def test_detokenize_stops_at_the_sequence_length_and_drops_special_tokens(tokenizer) -> None:
    ids = [*tokenizer.encode("A cat sits"), tokenizer.eos_token_id]
    padded = np.array([[[*ids, 0, 0, 0]]], dtype=np.int32)
    text = post.detokenize(tokenizer, padded, np.array([[len(ids)]]), True)
    assert text.shape == (1, 1)
    assert text[0, 0] == b"A cat sits"
    kept = post.detokenize(tokenizer, padded, np.array([[len(ids)]]), False)
    assert kept[0, 0].endswith(b"<|endoftext|>")
