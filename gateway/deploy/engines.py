"""Build the gpt2-medium TensorRT-LLM engine that model_repo/trtllm serves.

Meant to run inside the NGC Triton TensorRT-LLM container, whose TensorRT-LLM must be the
version pinned here: an engine only loads in the TensorRT-LLM (and TensorRT) it was built
with, and the example scripts change between releases. The steps are plain commands,
so `--dry-run` prints exactly what would run:

  1. check the container's TensorRT-LLM version (and, for fp8, that the GPU has FP8);
  2. fetch TensorRT-LLM's example scripts at the matching tag (sparse, examples/ only);
  3. download gpt2-medium from the Hugging Face Hub;
  4. convert it to a TensorRT-LLM checkpoint: convert_checkpoint.py for fp16, int8
     weight-only and int8 SmoothQuant; ModelOpt's quantize.py for int4 AWQ and fp8;
  5. trtllm-build with what in-flight batching needs (paged KV cache, packed input,
     the GPT attention plugin) into a staging folder;
  6. move the engine and the tokenizer into place, replacing an earlier build only once the
     new one is complete.
"""

from __future__ import annotations

import json
import os
import shlex
import subprocess
import sys
from dataclasses import dataclass, field
from enum import StrEnum
from pathlib import Path
from typing import TextIO

from gateway.deploy import ToolError

# The pinned pair: the NGC container and the TensorRT-LLM release it carries (NVIDIA's
# Triton compatibility matrix: 25.10-trtllm-python-py3 = TensorRT-LLM 1.0.0, TensorRT
# 10.11.0.33). Change both together, and re-check the example scripts' flags.
NGC_CONTAINER = "nvcr.io/nvidia/tritonserver:25.10-trtllm-python-py3"
TRTLLM_VERSION = "1.0.0"
TRTLLM_GIT_URL = "https://github.com/NVIDIA/TensorRT-LLM.git"
TRTLLM_GIT_TAG = f"v{TRTLLM_VERSION}"

HF_MODEL = "openai-community/gpt2-medium"
MODEL_NAME = "gpt2-medium"
# Only what conversion and the tokenizer need: no TF/Flax/ONNX copies of the weights.
HF_PATTERNS = ["*.json", "*.safetensors", "merges.txt", "vocab.json"]
TOKENIZER_FILES = [
    "config.json",
    "tokenizer.json",
    "tokenizer_config.json",
    "vocab.json",
    "merges.txt",
    "special_tokens_map.json",
]

# Under the fetched TensorRT-LLM tree.
GPT_CONVERT = "examples/models/core/gpt/convert_checkpoint.py"
GPT_REQUIREMENTS = "examples/models/core/gpt/requirements.txt"
QUANTIZE = "examples/quantization/quantize.py"
QUANTIZE_REQUIREMENTS = "examples/quantization/requirements.txt"

# FP8 tensor cores: Ada (8.9) and Hopper (9.0) onwards.
FP8_MIN_COMPUTE_CAPABILITY = 8.9


class Quantization(StrEnum):
    fp16 = "fp16"
    int8_wo = "int8_wo"
    int8_sq = "int8_sq"
    int4_awq = "int4_awq"
    fp8 = "fp8"


@dataclass(frozen=True)
class BuildSettings:
    workdir: Path
    engines_dir: Path
    quantization: Quantization = Quantization.fp16
    tp_size: int = 1
    max_batch_size: int = 64
    max_input_len: int = 768
    # gpt2-medium's context: prompt + output must fit in 1024 positions.
    max_seq_len: int = 1024
    max_num_tokens: int = 8192
    smoothquant_alpha: float = 0.5
    calib_size: int = 512
    hf_model: str = HF_MODEL

    def __post_init__(self) -> None:
        if self.tp_size < 1 or self.max_batch_size < 1 or self.max_input_len < 1:
            raise ToolError("tp-size, max-batch-size and max-input-len must be positive")
        if self.max_input_len >= self.max_seq_len:
            raise ToolError(f"max-input-len ({self.max_input_len}) must be below max-seq-len ({self.max_seq_len})")
        if not 0.0 <= self.smoothquant_alpha <= 1.0:
            raise ToolError("smoothquant alpha must be in [0, 1]")

    @property
    def trtllm_src(self) -> Path:
        return self.workdir / f"TensorRT-LLM-{TRTLLM_VERSION}"

    @property
    def hf_dir(self) -> Path:
        return self.workdir / "hf" / MODEL_NAME

    @property
    def variant(self) -> str:
        return f"{self.quantization.value}-tp{self.tp_size}"

    @property
    def checkpoint_dir(self) -> Path:
        return self.workdir / "checkpoints" / MODEL_NAME / self.variant

    @property
    def engine_dir(self) -> Path:
        return self.engines_dir / MODEL_NAME / self.variant

    @property
    def staging_dir(self) -> Path:
        return self.engines_dir / MODEL_NAME / f".{self.variant}.building"

    @property
    def tokenizer_dir(self) -> Path:
        return self.engines_dir / MODEL_NAME / "tokenizer"


@dataclass(frozen=True)
class Step:
    what: str
    argv: list[str]
    cwd: Path | None = None
    env: dict[str, str] = field(default_factory=dict)
    # Skip the step when this path exists (idempotent re-runs: no second download).
    unless_exists: Path | None = None

    def shell(self) -> str:
        line = " ".join(shlex.quote(a) for a in self.argv)
        if self.env:
            line = " ".join(f"{k}={shlex.quote(v)}" for k, v in self.env.items()) + " " + line
        if self.cwd is not None:
            line = f"(cd {shlex.quote(str(self.cwd))} && {line})"
        return line


def _python(code: str) -> list[str]:
    return ["python3", "-c", code]


def _lit(value: object) -> str:
    # Python literals in double quotes, so the printed command line stays readable.
    return json.dumps(value)


def plan(s: BuildSettings, check_version: bool = True) -> list[Step]:
    steps = []
    if check_version:
        steps.append(
            Step(
                f"check that this container carries TensorRT-LLM {TRTLLM_VERSION} ({NGC_CONTAINER})",
                _python(
                    "import sys, tensorrt_llm; v = tensorrt_llm.__version__; "
                    f"sys.exit(0 if v == {_lit(TRTLLM_VERSION)} else "
                    f'"TensorRT-LLM " + v + " found, {TRTLLM_VERSION} expected: use {NGC_CONTAINER}")'
                ),
            )
        )
    if s.quantization is Quantization.fp8:
        steps.append(
            Step(
                f"check that every GPU has FP8 (compute capability >= {FP8_MIN_COMPUTE_CAPABILITY})",
                _python(
                    'import subprocess, sys; caps = [float(c) for c in subprocess.run(["nvidia-smi", '
                    '"--query-gpu=compute_cap", "--format=csv,noheader"], capture_output=True, text=True, '
                    "check=True).stdout.split()]; "
                    f"sys.exit(0 if caps and min(caps) >= {FP8_MIN_COMPUTE_CAPABILITY} else "
                    '"fp8 needs Ada or Hopper GPUs (compute capability 8.9+), found " + str(caps))'
                ),
            )
        )
    steps += [
        Step(
            f"fetch TensorRT-LLM {TRTLLM_GIT_TAG} example scripts",
            [
                "git",
                "clone",
                "--depth",
                "1",
                "--branch",
                TRTLLM_GIT_TAG,
                "--filter=blob:none",
                "--sparse",
                TRTLLM_GIT_URL,
                str(s.trtllm_src),
            ],
            unless_exists=s.trtllm_src,
        ),
        Step("check out examples/ only", ["git", "-C", str(s.trtllm_src), "sparse-checkout", "set", "examples"]),
        Step(
            f"download {s.hf_model}",
            _python(
                "from huggingface_hub import snapshot_download; "
                f"snapshot_download({_lit(s.hf_model)}, local_dir={_lit(str(s.hf_dir))}, "
                f"allow_patterns={_lit(HF_PATTERNS)})"
            ),
            unless_exists=s.hf_dir / "config.json",
        ),
    ]
    steps += _convert(s)
    steps += [
        Step("clear an unfinished earlier build", ["rm", "-rf", str(s.staging_dir)]),
        Step(
            "build the engine (in-flight batching: paged KV cache, packed input, GPT attention plugin)",
            _trtllm_build(s),
        ),
        Step(
            "copy the tokenizer beside the engines (what AutoTokenizer reads)",
            _python(
                f"import pathlib, shutil; src = pathlib.Path({_lit(str(s.hf_dir))}); "
                f"dst = pathlib.Path({_lit(str(s.tokenizer_dir))}); dst.mkdir(parents=True, exist_ok=True); "
                f"[shutil.copy2(src / n, dst / n) for n in {_lit(TOKENIZER_FILES)} if (src / n).exists()]"
            ),
        ),
        Step("replace the served engine", ["rm", "-rf", str(s.engine_dir)]),
        Step("put the new engine in place", ["mv", str(s.staging_dir), str(s.engine_dir)]),
    ]
    return steps


def _convert(s: BuildSettings) -> list[Step]:
    src = s.trtllm_src
    # convert_checkpoint.py imports `examples.*` helpers in recent releases.
    env = {"PYTHONPATH": str(src)}
    common = [
        "--model_dir",
        str(s.hf_dir),
        "--dtype",
        "float16",
        "--tp_size",
        str(s.tp_size),
        "--output_dir",
        str(s.checkpoint_dir),
    ]
    q = s.quantization
    if q in (Quantization.fp16, Quantization.int8_wo, Quantization.int8_sq):
        extra: list[str] = []
        steps: list[Step] = []
        if q is Quantization.int8_wo:
            extra = ["--use_weight_only", "--weight_only_precision", "int8"]
        elif q is Quantization.int8_sq:
            # Calibration reads a dataset with `datasets`, which the example's requirements add.
            steps.append(
                Step(
                    "install the GPT example's requirements (calibration data)",
                    ["python3", "-m", "pip", "install", "-r", str(src / GPT_REQUIREMENTS)],
                    cwd=(src / GPT_REQUIREMENTS).parent,
                )
            )
            extra = ["--smoothquant", str(s.smoothquant_alpha), "--per_token", "--per_channel"]
        steps.append(
            Step(
                f"convert to a TensorRT-LLM checkpoint ({q.value})",
                ["python3", str(src / GPT_CONVERT), *common, *extra],
                env=env,
            )
        )
        return steps
    qformat = {
        Quantization.int4_awq: ["--qformat", "int4_awq", "--awq_block_size", "128"],
        Quantization.fp8: ["--qformat", "fp8", "--kv_cache_dtype", "fp8"],
    }[q]
    return [
        Step(
            "install the quantization example's requirements (ModelOpt, calibration data)",
            ["python3", "-m", "pip", "install", "-r", str(src / QUANTIZE_REQUIREMENTS)],
            cwd=(src / QUANTIZE_REQUIREMENTS).parent,
        ),
        Step(
            f"quantize with ModelOpt to a TensorRT-LLM checkpoint ({q.value})",
            ["python3", str(src / QUANTIZE), *common, *qformat, "--calib_size", str(s.calib_size)],
            env=env,
        ),
    ]


def _trtllm_build(s: BuildSettings) -> list[str]:
    return [
        "trtllm-build",
        "--checkpoint_dir",
        str(s.checkpoint_dir),
        "--output_dir",
        str(s.staging_dir),
        "--gemm_plugin",
        "auto",
        "--gpt_attention_plugin",
        "auto",
        "--kv_cache_type",
        "paged",
        "--remove_input_padding",
        "enable",
        "--context_fmha",
        "enable",
        # Lets the backend reuse KV blocks and chunk long prompts when the settings ask.
        "--use_paged_context_fmha",
        "enable",
        "--max_batch_size",
        str(s.max_batch_size),
        "--max_input_len",
        str(s.max_input_len),
        "--max_seq_len",
        str(s.max_seq_len),
        "--max_num_tokens",
        str(s.max_num_tokens),
        "--max_beam_width",
        "1",
        "--workers",
        str(s.tp_size),
    ]


def render_settings(s: BuildSettings, engines_mount: str = "/engines") -> str:
    """The [trtllm] settings that fit this engine, with paths as the compose file mounts them."""
    rel = s.engine_dir.relative_to(s.engines_dir)
    tok = s.tokenizer_dir.relative_to(s.engines_dir)
    return (
        "[trtllm]\n"
        f'engine_dir = "{engines_mount}/{rel.as_posix()}"\n'
        f'tokenizer_dir = "{engines_mount}/{tok.as_posix()}"\n'
        f"triton_max_batch_size = {s.max_batch_size}\n"
        f"max_input_len = {s.max_input_len}\n"
        f"tensor_parallel_size = {s.tp_size}\n"
    )


def run(steps: list[Step], dry_run: bool, out: TextIO | None = None) -> None:
    """Print each step, and run it unless dry_run; stop at the first that fails."""
    out = out or sys.stdout
    for number, step in enumerate(steps, 1):
        print(f"# {number}. {step.what}", file=out)
        if step.unless_exists is not None:
            print(f"#    (skipped when {step.unless_exists} exists)", file=out)
        print(step.shell(), file=out, flush=True)
        if dry_run:
            continue
        if step.unless_exists is not None and step.unless_exists.exists():
            print("#    already there, skipped", file=out)
            continue
        env = {**os.environ, **step.env}
        result = subprocess.run(step.argv, cwd=step.cwd, env=env)
        if result.returncode != 0:
            raise ToolError(f"step {number} ({step.what}) failed with exit code {result.returncode}")
