"""`gateway model-repo build-engines`: the command plan (--dry-run) and its execution."""

from __future__ import annotations

import io
import shlex
from pathlib import Path

import pytest
from typer.testing import CliRunner

from gateway.deploy import ToolError
from gateway.deploy.cli import app
from gateway.deploy.engines import TRTLLM_GIT_TAG, TRTLLM_VERSION, BuildSettings, Step, run

runner = CliRunner()


def _dry_run(*args: str) -> list[list[str]]:
    result = runner.invoke(app, ["build-engines", "--dry-run", "--workdir", "/w", "--engines-dir", "/engines", *args])
    assert result.exit_code == 0, result.output
    return [shlex.split(line) for line in result.output.splitlines() if line and not line.startswith("#")]


def _command(commands: list[list[str]], program: str, script: str | None = None) -> list[str]:
    """The single command running `program` (and `script`, for python)."""
    found = [c for c in commands if program in c and (script is None or any(a.endswith(script) for a in c))]
    assert len(found) == 1, f"{program} {script}: {found}"
    return found[0]


def _flags(argv: list[str]) -> dict[str, str | None]:
    flags: dict[str, str | None] = {}
    for i, arg in enumerate(argv):
        if arg.startswith("--"):
            nxt = argv[i + 1] if i + 1 < len(argv) and not argv[i + 1].startswith("--") else None
            flags[arg] = nxt
    return flags


def test_fp16_converts_with_convert_checkpoint_and_builds_for_in_flight_batching() -> None:
    commands = _dry_run()
    convert = _flags(_command(commands, "python3", "models/core/gpt/convert_checkpoint.py"))
    assert convert["--dtype"] == "float16"
    assert convert["--tp_size"] == "1"
    assert convert["--output_dir"] == "/w/checkpoints/gpt2-medium/fp16-tp1"
    assert "--use_weight_only" not in convert and "--smoothquant" not in convert
    build = _flags(_command(commands, "trtllm-build"))
    assert build["--checkpoint_dir"] == "/w/checkpoints/gpt2-medium/fp16-tp1"
    assert build["--kv_cache_type"] == "paged"
    assert build["--remove_input_padding"] == "enable"
    assert build["--gpt_attention_plugin"] == "auto"
    assert build["--max_batch_size"] == "64" and build["--max_input_len"] == "768"
    assert build["--max_seq_len"] == "1024"
    # Built into a staging folder, then moved where Triton reads it.
    assert build["--output_dir"] == "/engines/gpt2-medium/.fp16-tp1.building"
    assert ["mv", "/engines/gpt2-medium/.fp16-tp1.building", "/engines/gpt2-medium/fp16-tp1"] in commands


def test_every_plan_checks_the_pinned_tensorrt_llm_and_fetches_its_examples() -> None:
    commands = _dry_run()
    assert f'v == "{TRTLLM_VERSION}"' in commands[0][-1]
    clone = _command(commands, "clone")
    assert clone[clone.index("--branch") + 1] == TRTLLM_GIT_TAG
    assert any("snapshot_download" in c[-1] and "openai-community/gpt2-medium" in c[-1] for c in commands)


def test_int8_weight_only_adds_the_weight_only_flags() -> None:
    convert = _flags(_command(_dry_run("--quantization", "int8_wo"), "python3", "convert_checkpoint.py"))
    assert "--use_weight_only" in convert
    assert convert["--weight_only_precision"] == "int8"
    assert convert["--output_dir"] == "/w/checkpoints/gpt2-medium/int8_wo-tp1"


def test_int8_smoothquant_calibrates_per_token_and_per_channel() -> None:
    convert = _flags(_command(_dry_run("--quantization", "int8_sq"), "python3", "convert_checkpoint.py"))
    assert convert["--smoothquant"] == "0.5"
    assert "--per_token" in convert and "--per_channel" in convert


def test_int4_awq_quantizes_with_modelopt_then_builds() -> None:
    commands = _dry_run("--quantization", "int4_awq")
    assert not [c for c in commands if any(a.endswith("convert_checkpoint.py") for a in c)]
    quantize = _flags(_command(commands, "python3", "examples/quantization/quantize.py"))
    assert quantize["--qformat"] == "int4_awq"
    assert quantize["--awq_block_size"] == "128"
    assert quantize["--output_dir"] == "/w/checkpoints/gpt2-medium/int4_awq-tp1"
    build = _flags(_command(commands, "trtllm-build"))
    assert build["--checkpoint_dir"] == "/w/checkpoints/gpt2-medium/int4_awq-tp1"


def test_tensor_parallel_size_2_shards_the_checkpoint_and_builds_both_ranks() -> None:
    commands = _dry_run("--tp-size", "2")
    convert = _flags(_command(commands, "python3", "convert_checkpoint.py"))
    assert convert["--tp_size"] == "2"
    build = _flags(_command(commands, "trtllm-build"))
    assert build["--workers"] == "2"
    assert build["--output_dir"] == "/engines/gpt2-medium/.fp16-tp2.building"
    result = runner.invoke(app, ["build-engines", "--dry-run", "--tp-size", "2"])
    assert "tensor_parallel_size = 2" in result.output


def test_fp8_first_checks_that_the_gpu_has_fp8() -> None:
    commands = _dry_run("--quantization", "fp8")
    assert any("compute_cap" in c[-1] for c in commands[:3])
    quantize = _flags(_command(commands, "python3", "quantize.py"))
    assert quantize["--qformat"] == "fp8" and quantize["--kv_cache_dtype"] == "fp8"


def test_unknown_quantization_is_refused() -> None:
    result = runner.invoke(app, ["build-engines", "--dry-run", "--quantization", "int2"])
    assert result.exit_code == 2
    assert "fp16, int8_wo, int8_sq, int4_awq, fp8" in result.output


def test_input_longer_than_the_sequence_is_refused() -> None:
    with pytest.raises(ToolError, match="below max-seq-len"):
        BuildSettings(workdir=Path("/w"), engines_dir=Path("/e"), max_input_len=1024, max_seq_len=1024)


def test_run_executes_steps_in_order_and_stops_at_a_failure(tmp_path: Path) -> None:
    marker = tmp_path / "ran"
    steps = [
        Step("first", ["touch", str(marker)]),
        Step("skipped: already there", ["false"], unless_exists=marker),
        Step("fails", ["false"]),
        Step("never", ["touch", str(tmp_path / "never")]),
    ]
    with pytest.raises(ToolError, match="step 3 \\(fails\\)"):
        run(steps, dry_run=False, out=io.StringIO())
    assert marker.exists()
    assert not (tmp_path / "never").exists()


def test_dry_run_runs_nothing(tmp_path: Path) -> None:
    out = io.StringIO()
    run([Step("make a file", ["touch", str(tmp_path / "x")])], dry_run=True, out=out)
    assert not (tmp_path / "x").exists()
    assert f"touch {tmp_path / 'x'}" in out.getvalue()
