"""Triton python model: token ids of one tensorrt_llm response -> text.

tensorrt_llm is decoupled: while streaming, each of its responses holds only the tokens
generated since the previous one, and the ensemble runs this model once per response. So
each response is detokenized on its own and the client receives text as it is produced.
(Stateless by design: a character split across two responses, which byte-level BPE can do
for non-ASCII text, arrives as U+FFFD in each half.)
"""

from __future__ import annotations

import json
from typing import Any

import numpy as np

try:
    import triton_python_backend_utils as pb_utils
except ImportError:  # imported by tests outside Triton: only the helpers are used
    pb_utils = None


def load_tokenizer(tokenizer_dir: str) -> Any:
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(tokenizer_dir)


def detokenize(
    tokenizer: Any, output_ids: np.ndarray, sequence_length: np.ndarray, skip_special_tokens: bool
) -> np.ndarray:
    """output_ids [batch, beams, n] and sequence_length [batch, beams] -> UTF-8 bytes
    [batch, beams]; ids past each sequence's length are padding."""
    batch, beams = output_ids.shape[0], output_ids.shape[1]
    texts = np.empty((batch, beams), dtype=object)
    for b in range(batch):
        for k in range(beams):
            tokens = output_ids[b, k, : int(sequence_length[b, k])].tolist()
            texts[b, k] = tokenizer.decode(tokens, skip_special_tokens=skip_special_tokens).encode("utf-8")
    return texts


class TritonPythonModel:
    def initialize(self, args: dict[str, str]) -> None:
        config = json.loads(args["model_config"])
        params = {key: value["string_value"] for key, value in config.get("parameters", {}).items()}
        self.tokenizer = load_tokenizer(params["tokenizer_dir"])
        self.skip_special_tokens = params.get("skip_special_tokens", "true").lower() == "true"

    def execute(self, requests: list[Any]) -> list[Any]:
        responses = []
        for request in requests:
            output_ids = pb_utils.get_input_tensor_by_name(request, "output_ids").as_numpy()
            lengths = pb_utils.get_input_tensor_by_name(request, "sequence_length").as_numpy()
            text = detokenize(self.tokenizer, output_ids, lengths, self.skip_special_tokens)
            responses.append(pb_utils.InferenceResponse(output_tensors=[pb_utils.Tensor("text_output", text)]))
        return responses
