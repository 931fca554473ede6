"""`gateway model-repo render`: templates, settings validation, repository checks."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
from tritonclient.grpc import model_config_pb2
from typer.testing import CliRunner

from gateway.deploy import MODEL_REPO, ToolError
from gateway.deploy.cli import app
from gateway.deploy.render import DERIVED, PROFILES, Profile, check_repo, load_repo, parse_config, render

from .conftest import REQUIRED

runner = CliRunner()


def _io(config) -> tuple[list[tuple], list[tuple]]:
    def describe(tensors):
        return sorted((t.name, t.data_type, tuple(t.dims), getattr(t, "optional", False)) for t in tensors)

    return describe(config.input), describe(config.output)


def test_every_config_of_every_profile_parses(rendered: dict[str, Path]) -> None:
    assert set(PROFILES) == {"local", *rendered}
    parsed = {name: load_repo(repo) for name, repo in rendered.items()}
    parsed["local"] = load_repo(MODEL_REPO / "local")
    for profile, configs in parsed.items():
        assert configs, f"{profile} has no models"
        source = MODEL_REPO / profile
        assert set(configs) == {p.parent.name for p in source.glob("*/config.pbtxt")}


def test_rendered_repositories_pass_the_ensemble_checks(rendered: dict[str, Path]) -> None:
    for name, repo in rendered.items():
        configs = check_repo(repo)
        # (llmapi is one python model: no ensemble.)
        assert any(c.platform == "ensemble" for c in configs.values()) or name == "llmapi"


def test_trtllm_llm_has_the_inputs_and_outputs_of_the_local_llm(rendered: dict[str, Path]) -> None:
    local = parse_config(MODEL_REPO / "local" / "llm" / "config.pbtxt")
    trtllm = parse_config(rendered["trtllm"] / "llm" / "config.pbtxt")
    assert trtllm.name == local.name == "llm"
    assert _io(trtllm) == _io(local)


def test_clip_trt_ensembles_have_the_inputs_and_outputs_of_the_local_ones(rendered: dict[str, Path]) -> None:
    for name in ("clip_image", "clip_text"):
        local = parse_config(MODEL_REPO / "local" / name / "config.pbtxt")
        gpu = parse_config(rendered["clip_trt"] / name / "config.pbtxt")
        assert gpu.name == local.name
        assert _io(gpu) == _io(local)
        assert gpu.max_batch_size == local.max_batch_size


def test_clip_text_and_image_render_their_own_max_batch_size_through_every_step(tmp_path: Path) -> None:
    sizes = {"image_max_batch_size": 8, "text_max_batch_size": 48}
    render(["clip_trt"], tmp_path / "r", settings={"clip_trt": {"hf_model_dir": "/hf", **sizes}})
    configs = load_repo(tmp_path / "r")
    image = ("clip_image", "clip_trt_image_preprocessing", "clip_trt_vision")
    text = ("clip_text", "clip_trt_tokenizer", "clip_trt_text_encoder")
    assert {configs[name].max_batch_size for name in image} == {8}
    assert {configs[name].max_batch_size for name in text} == {48}


def test_export_clip_builds_each_plan_for_its_towers_rendered_max_batch_size(rendered: dict[str, Path]) -> None:
    """The defaults agree: the text plan's profile reaches clip_text's 64, the vision plan's
    clip_image's 16."""
    text = parse_config(rendered["clip_trt"] / "clip_trt_text_encoder" / "config.pbtxt").max_batch_size
    vision = parse_config(rendered["clip_trt"] / "clip_trt_vision" / "config.pbtxt").max_batch_size
    assert (text, vision) == (64, 16)
    result = runner.invoke(app, ["export-clip", "--repo", str(rendered["clip_trt"]), "--dry-run"])
    assert result.exit_code == 0, result.output
    assert f"--maxShapes=input_ids:{text}x77,attention_mask:{text}x77" in result.output
    assert f"--maxShapes=pixel_values:{vision}x3x224x224" in result.output


def test_trtllm_step_uses_the_tensorrtllm_backend_with_in_flight_batching(rendered: dict[str, Path]) -> None:
    config = parse_config(rendered["trtllm"] / "trtllm_tensorrt_llm" / "config.pbtxt")
    assert config.backend == "tensorrtllm"
    assert config.model_transaction_policy.decoupled is True
    params = {k: v.string_value for k, v in config.parameters.items()}
    assert params["gpt_model_type"] == "inflight_fused_batching"
    assert params["gpt_model_path"] == REQUIRED["trtllm"]["engine_dir"]


def test_clip_towers_are_batched_tensorrt_plans(rendered: dict[str, Path]) -> None:
    for name in ("clip_trt_vision", "clip_trt_text_encoder"):
        config = parse_config(rendered["clip_trt"] / name / "config.pbtxt")
        assert config.platform == "tensorrt_plan"
        assert config.HasField("dynamic_batching")


def test_every_placeholder_is_a_declared_parameter() -> None:
    for name in ("trtllm", "clip_trt", "llmapi"):
        profile = Profile.load(name)
        assert profile.placeholders() <= set(profile.params) | set(DERIVED.get(name, ()))
        # Only engine-check parameters, and those values are derived from, may appear in no template.
        assert set(profile.params) - profile.placeholders() <= {"tensor_parallel_size", "cuda_graphs"}


def test_settings_file_values_are_used_and_set_overrides_them(tmp_path: Path) -> None:
    settings = tmp_path / "deploy.toml"
    settings.write_text(
        '[trtllm]\nengine_dir = "/e"\ntokenizer_dir = "/t"\ntriton_max_batch_size = 32\ndecoupled_mode = true\n'
    )
    out = tmp_path / "repo"
    result = runner.invoke(
        app, ["render", "-p", "trtllm", "-s", str(settings), "--set", "trtllm.triton_max_batch_size=16", "-o", str(out)]
    )
    assert result.exit_code == 0, result.output
    configs = load_repo(out)
    assert {c.max_batch_size for c in configs.values()} == {16}
    assert configs["trtllm_tensorrt_llm"].parameters["gpt_model_path"].string_value == "/e"


def test_unknown_key_is_refused_with_its_name(tmp_path: Path) -> None:
    result = runner.invoke(
        app,
        [
            "render",
            "-p",
            "trtllm",
            "-o",
            str(tmp_path / "r"),
            "--set",
            "trtllm.engine_dir=/e",
            "--set",
            "trtllm.tokenizer_dir=/t",
            "--set",
            "trtllm.max_batch=8",
        ],
    )
    assert result.exit_code == 2
    assert "unknown key(s) max_batch" in result.output
    assert not (tmp_path / "r").exists()


def test_missing_required_keys_are_refused_with_their_names(tmp_path: Path) -> None:
    result = runner.invoke(app, ["render", "-p", "trtllm", "-o", str(tmp_path / "r")])
    assert result.exit_code == 2
    assert "missing required key(s) engine_dir, tokenizer_dir" in result.output


def test_settings_for_a_profile_not_rendered_are_refused(tmp_path: Path) -> None:
    settings = tmp_path / "s.toml"
    settings.write_text('[clip_trt]\nhf_model_dir = "/hf"\n[trtlm]\nengine_dir = "/e"\n')
    result = runner.invoke(app, ["render", "-p", "clip_trt", "-s", str(settings), "-o", str(tmp_path / "r")])
    assert result.exit_code == 2
    assert "trtlm" in result.output


@pytest.mark.parametrize(
    ("setting", "message"),
    [
        ("trtllm.decoupled_mode=maybe", "decoupled_mode must be bool"),
        ("trtllm.triton_max_batch_size=0", "triton_max_batch_size must be >= 1"),
        ("trtllm.kv_cache_free_gpu_mem_fraction=1.5", "kv_cache_free_gpu_mem_fraction must be <= 0.99"),
        ("trtllm.batching_strategy=v1", "batching_strategy must be one of"),
    ],
)
def test_bad_values_are_refused(tmp_path: Path, setting: str, message: str) -> None:
    result = runner.invoke(
        app,
        [
            "render",
            "-p",
            "trtllm",
            "-o",
            str(tmp_path / "r"),
            "--set",
            "trtllm.engine_dir=/e",
            "--set",
            "trtllm.tokenizer_dir=/t",
            "--set",
            setting,
        ],
    )
    assert result.exit_code == 2
    assert message in result.output


def test_string_values_are_escaped_for_pbtxt(tmp_path: Path) -> None:
    out = tmp_path / "r"
    render(["trtllm"], out, settings={"trtllm": {"engine_dir": '/e/"odd"\\dir', "tokenizer_dir": "/t"}})
    config = parse_config(out / "trtllm_tensorrt_llm" / "config.pbtxt")
    assert config.parameters["gpt_model_path"].string_value == '/e/"odd"\\dir'


def test_render_replaces_an_earlier_render_only_with_force(tmp_path: Path) -> None:
    out = tmp_path / "r"
    settings = {"clip_trt": {"hf_model_dir": "/hf"}}
    render(["clip_trt"], out, settings=settings)
    with pytest.raises(ToolError, match="--force"):
        render(["clip_trt"], out, settings=settings)
    render(["clip_trt"], out, settings={"clip_trt": {"hf_model_dir": "/hf", "image_max_batch_size": 8}}, force=True)
    assert parse_config(out / "clip_image" / "config.pbtxt").max_batch_size == 8


def test_render_never_replaces_a_folder_that_is_not_a_model_repository(tmp_path: Path) -> None:
    out = tmp_path / "home"
    out.mkdir()
    (out / "notes.txt").write_text("keep me")
    with pytest.raises(ToolError, match="refusing"):
        render(["clip_trt"], out, settings={"clip_trt": {"hf_model_dir": "/hf"}}, force=True)
    assert (out / "notes.txt").read_text() == "keep me"


def test_profiles_with_the_same_model_name_are_refused(tmp_path: Path) -> None:
    with pytest.raises(ToolError, match="two profiles"):
        render(["local", "trtllm"], tmp_path / "r", settings={"trtllm": dict(REQUIRED["trtllm"])})


def test_check_repo_finds_a_data_type_mismatch(rendered: dict[str, Path], tmp_path: Path) -> None:
    repo = tmp_path / "broken"
    shutil.copytree(rendered["trtllm"], repo)
    pre = repo / "trtllm_preprocessing" / "config.pbtxt"
    pre.write_text(
        pre.read_text().replace('name: "out_end_id" data_type: TYPE_INT32', 'name: "out_end_id" data_type: TYPE_UINT32')
    )
    with pytest.raises(ToolError, match="different data type"):
        check_repo(repo)


def test_check_repo_finds_an_unknown_step_input(rendered: dict[str, Path], tmp_path: Path) -> None:
    repo = tmp_path / "broken"
    shutil.copytree(rendered["trtllm"], repo)
    ens = repo / "llm" / "config.pbtxt"
    ens.write_text(ens.read_text().replace('key: "seed"', 'key: "random_seed"'))
    with pytest.raises(ToolError, match="has no input 'random_seed'"):
        check_repo(repo)


# ---- engine config.json checks ---------------------------------------------------------


def _engine(tmp_path: Path, max_batch: int = 64, max_input: int = 768, tp: int = 1) -> Path:
    engine = tmp_path / "engine"
    engine.mkdir()
    config = {
        "version": "1.0.0",
        "pretrained_config": {
            "architecture": "GPTForCausalLM",
            "mapping": {"world_size": tp, "tp_size": tp, "pp_size": 1},
        },
        "build_config": {"max_batch_size": max_batch, "max_input_len": max_input, "max_seq_len": 1024},
    }
    (engine / "config.json").write_text(json.dumps(config))
    for rank in range(tp):
        (engine / f"rank{rank}.engine").write_bytes(b"")
    return engine


def _render_against(tmp_path: Path, engine: Path, **values: object):
    settings = {"trtllm": {**REQUIRED["trtllm"], **values}}
    return render(["trtllm"], tmp_path / "repo", settings=settings, engine_dir=engine)


def test_engine_that_fits_the_settings_is_accepted(tmp_path: Path) -> None:
    result = _render_against(tmp_path, _engine(tmp_path, tp=2), tensor_parallel_size=2)
    assert any("fits the settings" in note for note in result.notes)


@pytest.mark.parametrize(
    ("engine_args", "values", "message"),
    [
        ({"max_batch": 8}, {"triton_max_batch_size": 64}, "engine max_batch_size=8"),
        ({"max_input": 512}, {"max_input_len": 768}, "engine max_input_len=512"),
        ({"tp": 2}, {"tensor_parallel_size": 1}, "the engine has tp_size=2"),
    ],
)
def test_engine_that_does_not_fit_is_refused(tmp_path: Path, engine_args: dict, values: dict, message: str) -> None:
    with pytest.raises(ToolError, match=message):
        _render_against(tmp_path, _engine(tmp_path, **engine_args), **values)
    assert not (tmp_path / "repo").exists()


def test_engine_with_a_missing_rank_file_is_refused(tmp_path: Path) -> None:
    engine = _engine(tmp_path, tp=2)
    (engine / "rank1.engine").unlink()
    with pytest.raises(ToolError, match=r"rank1\.engine"):
        _render_against(tmp_path, engine, tensor_parallel_size=2)


def test_named_engine_dir_without_config_is_refused(tmp_path: Path) -> None:
    with pytest.raises(ToolError, match=r"no config\.json"):
        _render_against(tmp_path, tmp_path)


def test_the_local_engine_has_the_inputs_and_outputs_of_tensorrt_llm(rendered: dict[str, Path]) -> None:
    trtllm = parse_config(rendered["trtllm"] / "trtllm_tensorrt_llm" / "config.pbtxt")
    for name in ("llm_engine", "llm_synthetic", "llm_echo"):
        local = parse_config(MODEL_REPO / "local" / name / "config.pbtxt")
        inputs, outputs = _io(local)
        # One input beyond TensorRT-LLM's Triton model: cache_salt_id, its executor's per-request
        # prefix-cache salt (the gateway sends it where the model spec says cache_salt).
        assert [i for i in inputs if i[0] == "cache_salt_id"], name
        assert ([i for i in inputs if i[0] != "cache_salt_id"], outputs) == _io(trtllm), name
        assert local.model_transaction_policy.decoupled is True


# ---- the llmapi repository (TensorRT-LLM's PyTorch backend) ------------------------------

# TensorRT-LLM's triton_backend/all_models/llmapi/tensorrt_llm/config.pbtxt (NVIDIA/TensorRT-LLM,
# 2026): name -> (data type, dims, optional). Outputs are never optional.
_S, _B, _I, _F, _U, _L = "TYPE_STRING", "TYPE_BOOL", "TYPE_INT32", "TYPE_FP32", "TYPE_UINT64", "TYPE_INT64"
LLMAPI_INPUTS = {
    "text_input": (_S, (-1,), False),
    "image_url": (_S, (-1,), True),
    "streaming": (_B, (1,), True),
    "sampling_param_best_of": (_I, (1,), True),
    "sampling_param_temperature": (_F, (1,), True),
    "sampling_param_top_k": (_I, (1,), True),
    "sampling_param_top_p": (_F, (1,), True),
    "sampling_param_frequency_penalty": (_F, (1,), True),
    "sampling_param_presence_penalty": (_F, (1,), True),
    "sampling_param_max_tokens": (_I, (1,), True),
    "sampling_param_stop": (_S, (-1,), True),
    "sampling_param_seed": (_U, (1,), True),
    "sampling_param_exclude_input_from_output": (_B, (1,), True),
    "sampling_param_return_perf_metrics": (_B, (1,), True),
    "return_finish_reason": (_B, (1,), True),
    "return_stop_reason": (_B, (1,), True),
    "return_cumulative_logprob": (_B, (1,), True),
    "stop": (_B, (1,), True),
    "lora_id": (_U, (1,), True),
    "lora_name": (_S, (1,), True),
    "lora_path": (_S, (1,), True),
    "lora_ckpt_source": (_S, (1,), True),
}
LLMAPI_OUTPUTS = {
    "text_output": (_S, (-1,)),
    "finish_reason": (_S, (-1,)),
    "stop_reason": (_S, (-1,)),
    "cumulative_logprob": (_F, (-1,)),
    "kv_cache_reused_block": (_I, (-1,)),
    "kv_cache_missed_block": (_I, (-1,)),
    "kv_cache_alloc_new_blocks": (_I, (-1,)),
    "kv_cache_alloc_total_blocks": (_I, (-1,)),
    "kv_cache_hit_rate": (_F, (-1,)),
    "arrival_time_ns": (_L, (1,)),
    "first_scheduled_time_ns": (_L, (1,)),
    "first_token_time_ns": (_L, (1,)),
    "last_token_time_ns": (_L, (1,)),
    "acceptance_rate": (_F, (1,)),
    "total_accepted_draft_tokens": (_I, (1,)),
    "total_draft_tokens": (_I, (1,)),
}


def _model_yaml(repo: Path) -> dict:
    import yaml

    return yaml.safe_load((repo / "tensorrt_llm" / "1" / "model.yaml").read_text())


def _type_name(value: int) -> str:
    return model_config_pb2.DataType.Name(value)


def test_llmapi_repository_has_the_layout_of_tensorrt_llm_s_llmapi_folder(rendered: dict[str, Path], tmp_path) -> None:
    source = tmp_path / "trtllm-llmapi"
    source.mkdir()
    for name in ("model.py", "helpers.py"):
        (source / name).write_text(f"# {name} of TensorRT-LLM\n")
    out = tmp_path / "repo"
    render(["llmapi"], out, settings={"llmapi": dict(REQUIRED["llmapi"])}, llmapi_source=source)
    files = {str(p.relative_to(out)) for p in out.rglob("*") if p.is_file()}
    assert files == {
        "tensorrt_llm/config.pbtxt",
        "tensorrt_llm/1/model.yaml",
        "tensorrt_llm/1/model.py",
        "tensorrt_llm/1/helpers.py",
    }
    without = {str(p.relative_to(rendered["llmapi"])) for p in rendered["llmapi"].rglob("*") if p.is_file()}
    assert without == {"tensorrt_llm/config.pbtxt", "tensorrt_llm/1/model.yaml"}


def test_llmapi_config_has_tensorrt_llm_s_inputs_and_outputs(rendered: dict[str, Path]) -> None:
    config = parse_config(rendered["llmapi"] / "tensorrt_llm" / "config.pbtxt")
    assert (config.name, config.backend) == ("tensorrt_llm", "python")
    inputs = {t.name: (_type_name(t.data_type), tuple(t.dims), t.optional) for t in config.input}
    outputs = {t.name: (_type_name(t.data_type), tuple(t.dims)) for t in config.output}
    assert inputs == LLMAPI_INPUTS
    assert outputs == LLMAPI_OUTPUTS
    # As model.yaml's triton_config says (model.py applies it where auto-complete is on).
    assert config.max_batch_size == 0
    assert config.model_transaction_policy.decoupled is True


def test_llmapi_model_yaml_holds_the_keys_model_py_reads(rendered: dict[str, Path]) -> None:
    document = _model_yaml(rendered["llmapi"])
    assert document["model"] == REQUIRED["llmapi"]["model"]
    assert document["backend"] == "pytorch"
    assert document["tensor_parallel_size"] == document["pipeline_parallel_size"] == 1
    assert document["triton_config"] == {"max_batch_size": 0, "decoupled": True, "cancellation_check_period_ms": 100}
    assert document["max_batch_size"] == 64
    assert document["cuda_graph_config"] == {"enable_padding": True, "max_batch_size": 64}
    assert document["kv_cache_config"] == {"free_gpu_memory_fraction": 0.9, "enable_block_reuse": True}


def test_llmapi_settings_reach_model_yaml(tmp_path: Path) -> None:
    values = {
        **REQUIRED["llmapi"],
        "tensor_parallel_size": 2,
        "pipeline_parallel_size": 2,
        "max_batch_size": 16,
        "decoupled_mode": False,
        "cuda_graphs": False,
    }
    render(["llmapi"], tmp_path / "repo", settings={"llmapi": values})
    document = _model_yaml(tmp_path / "repo")
    assert (document["tensor_parallel_size"], document["pipeline_parallel_size"]) == (2, 2)
    assert document["max_batch_size"] == 16
    assert document["triton_config"]["decoupled"] is False
    assert parse_config(tmp_path / "repo" / "tensorrt_llm" / "config.pbtxt").model_transaction_policy.decoupled is False
    assert document["cuda_graph_config"] is None


def test_llmapi_model_path_is_quoted_for_yaml(tmp_path: Path) -> None:
    odd = '/hf/"odd" model\\dir: x'
    render(["llmapi"], tmp_path / "repo", settings={"llmapi": {"model": odd}})
    assert _model_yaml(tmp_path / "repo")["model"] == odd


def test_llmapi_source_without_the_model_code_is_refused(tmp_path: Path) -> None:
    args = ["render", "-p", "llmapi", "--set", "llmapi.model=/hf/m", "-o", str(tmp_path / "r")]
    result = runner.invoke(app, [*args, "--llmapi-source", str(tmp_path)])
    assert result.exit_code == 2
    assert "no model.py, helpers.py there" in result.output
    assert not (tmp_path / "r").exists()


def test_check_repo_refuses_an_llmapi_config_that_disagrees_with_model_yaml(
    rendered: dict[str, Path], tmp_path: Path
) -> None:
    repo = tmp_path / "broken"
    shutil.copytree(rendered["llmapi"], repo)
    config = repo / "tensorrt_llm" / "config.pbtxt"
    config.write_text(config.read_text().replace("decoupled: true", "decoupled: false"))
    with pytest.raises(ToolError, match="decoupled differs"):
        check_repo(repo)


def test_the_local_llmapi_stand_in_has_the_inputs_and_outputs_of_tensorrt_llm_s(rendered: dict[str, Path]) -> None:
    real = parse_config(rendered["llmapi"] / "tensorrt_llm" / "config.pbtxt")
    local = parse_config(MODEL_REPO / "local" / "llm_llmapi" / "config.pbtxt")
    assert _io(local) == _io(real)
    assert local.max_batch_size == 0
    assert local.model_transaction_policy.decoupled is True
