"""The local stack's model repository rendered for its device (STACK_DEVICE): CPU as
written, CUDA with the embedding towers on the GPU. Rendered and parsed, no GPU needed."""

from __future__ import annotations

import sysconfig
from pathlib import Path

import pytest
from tritonclient.grpc import model_config_pb2

from gateway.deploy import MODEL_REPO
from gateway.deploy.render import check_repo, load_repo
from gateway.stack import devices
from gateway.stack.process import LaunchError
from gateway.stack.settings import StackSettings
from gateway.stack.stack import prepare_model_repo
from gateway.stack.triton import TritonInstall

KIND_CPU = model_config_pb2.ModelInstanceGroup.KIND_CPU
KIND_GPU = model_config_pb2.ModelInstanceGroup.KIND_GPU
NOTES = {"llm": "tiny gpt2 (test)", "clip": "tiny clip (test)"}
TOWERS = {"text_embed", "clip_vision", "clip_text_encoder"}


def _render(tmp_path: Path, device: devices.Device, instances: int = 1) -> dict[str, model_config_pb2.ModelConfig]:
    repo = prepare_model_repo(MODEL_REPO / "local", tmp_path / f"repo-{device}", NOTES, device, instances=instances)
    return check_repo(repo)


def _as_written(config: model_config_pb2.ModelConfig) -> model_config_pb2.ModelConfig:
    """The config without what the launcher adds to every one: its weights note, and the
    device of a model that places itself (the LLM engines' `device` parameter)."""
    copy = model_config_pb2.ModelConfig()
    copy.CopyFrom(config)
    for key in ("weights", "device"):
        if key in copy.parameters:
            del copy.parameters[key]
    return copy


def _placing_themselves(configs: dict[str, model_config_pb2.ModelConfig]) -> set[str]:
    return {name for name, config in configs.items() if "device" in config.parameters}


def test_on_cpu_every_model_is_as_written(tmp_path: Path) -> None:
    source = load_repo(MODEL_REPO / "local")
    rendered = _render(tmp_path, "cpu")
    assert set(rendered) == set(source)
    for name, config in rendered.items():
        assert _as_written(config) == _as_written(source[name]), name
        assert all(group.kind != KIND_GPU for group in config.instance_group)
    assert "llm_engine" in _placing_themselves(source)
    for name in _placing_themselves(source):
        assert rendered[name].parameters["device"].string_value == "cpu"


def test_on_cuda_the_embedding_towers_run_on_the_gpu_in_fp16_with_larger_batches(tmp_path: Path) -> None:
    source = load_repo(MODEL_REPO / "local")
    rendered = _render(tmp_path, "cuda")
    for name in TOWERS:
        config, batching = rendered[name], devices.GPU_MODELS[name]
        assert [(g.kind, g.count) for g in config.instance_group] == [(KIND_GPU, 1)]
        assert config.parameters["dtype"].string_value == "float16"
        assert config.max_batch_size == batching.max_batch_size > source[name].max_batch_size
        assert list(config.dynamic_batching.preferred_batch_size) == list(batching.preferred_batch_sizes)
        assert max(config.dynamic_batching.preferred_batch_size) <= config.max_batch_size
        assert config.dynamic_batching.max_queue_delay_microseconds < 2000
        # Inputs, outputs and weights are the same models'.
        assert list(config.input) == list(source[name].input)
        assert list(config.output) == list(source[name].output)
        assert config.parameters["model_dir"] == source[name].parameters["model_dir"]


def test_on_cuda_the_llm_engine_uses_cuda_and_the_cpu_steps_stay_on_the_cpu(tmp_path: Path) -> None:
    source = load_repo(MODEL_REPO / "local")
    rendered = _render(tmp_path, "cuda")
    for name in _placing_themselves(source):
        assert rendered[name].parameters["device"].string_value == "cuda"
    for name, config in rendered.items():
        if name not in TOWERS and devices.GPU_FEEDERS.get(name) != KIND_GPU:
            assert _as_written(config) == _as_written(source[name]), name


def test_on_cuda_the_image_step_runs_on_the_gpu_and_the_tokenizer_on_the_cpu(tmp_path: Path) -> None:
    source = load_repo(MODEL_REPO / "local")
    rendered = _render(tmp_path, "cuda")
    assert [(g.kind, g.count) for g in rendered["clip_image_preprocessing"].instance_group] == [(KIND_GPU, 1)]
    assert [(g.kind, g.count) for g in rendered["clip_tokenizer"].instance_group] == [(KIND_CPU, 1)]
    # only its placement changes: the step's batches, inputs and outputs are as written
    image_step = rendered["clip_image_preprocessing"]
    del image_step.instance_group[:]
    image_step.instance_group.extend(source["clip_image_preprocessing"].instance_group)
    assert _as_written(image_step) == _as_written(source["clip_image_preprocessing"])


def test_on_cuda_the_towers_and_the_cpu_steps_feeding_them_run_as_many_instances(tmp_path: Path) -> None:
    source = load_repo(MODEL_REPO / "local")
    rendered = _render(tmp_path, "cuda", instances=8)
    for name in TOWERS:
        assert [(g.kind, g.count) for g in rendered[name].instance_group] == [(KIND_GPU, 8)]
    for name, kind in devices.GPU_FEEDERS.items():
        assert [(g.kind, g.count) for g in rendered[name].instance_group] == [(kind, 8)]
    for name, config in rendered.items():
        if name not in TOWERS and name not in devices.GPU_FEEDERS:
            assert _as_written(config) == _as_written(source[name]), name


def test_instances_on_cuda_are_one_per_two_cores_within_one_to_eight() -> None:
    assert [devices.gpu_instances(cores) for cores in (1, 2, 3, 8, 16, 64)] == [1, 1, 1, 4, 8, 8]
    assert [devices.threads_per_instance(cores) for cores in (1, 2, 8, 16, 64)] == [1, 2, 2, 2, 8]


def test_every_ensemble_step_takes_the_ensembles_batches_on_either_device(tmp_path: Path) -> None:
    for device in ("cpu", "cuda"):
        rendered = _render(tmp_path, device)
        for config in rendered.values():
            if config.platform != "ensemble":
                continue
            for step in config.ensemble_scheduling.step:
                assert rendered[step.model_name].max_batch_size >= config.max_batch_size, (device, step.model_name)


def test_each_stub_takes_one_thread_on_cpu_and_its_share_of_the_cores_on_cuda(tmp_path: Path) -> None:
    install = TritonInstall.find()
    assert install.environment("cpu", tmp_path)["OMP_NUM_THREADS"] == "1"
    assert install.environment("cuda", tmp_path)["OMP_NUM_THREADS"] == str(devices.threads_per_instance())


def test_the_stubs_library_path_holds_libpython_and_nothing_else_of_its_folder(tmp_path: Path) -> None:
    # The interpreter's LIBDIR may be the system's library folder, whose CUDA libraries then
    # shadowed torch's own in every stub (its decode step 1.5x slower on an H100).
    install = TritonInstall.find()
    paths = install.environment("cuda", tmp_path)["LD_LIBRARY_PATH"].split(":")
    libdir, name = sysconfig.get_config_var("LIBDIR"), sysconfig.get_config_var("INSTSONAME")
    assert libdir not in paths
    assert str(install.libs) in paths
    private = Path(paths[-1])
    assert [entry.name for entry in private.iterdir()] == [name]
    assert (private / name).resolve() == (Path(libdir) / name).resolve()


def test_stack_device_setting(monkeypatch: pytest.MonkeyPatch) -> None:
    assert StackSettings().device == "auto"
    monkeypatch.setenv("STACK_DEVICE", "cuda")
    assert StackSettings().device == "cuda"
    monkeypatch.setenv("STACK_DEVICE", "gpu")
    with pytest.raises(ValueError, match="device"):
        StackSettings()


def test_auto_is_cuda_only_where_torch_sees_a_gpu(monkeypatch: pytest.MonkeyPatch) -> None:
    import torch

    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert devices.resolve_device("auto") == "cpu"
    assert devices.resolve_device("cpu") == "cpu"
    with pytest.raises(LaunchError, match="sees no GPU"):
        devices.resolve_device("cuda")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    assert devices.resolve_device("auto") == "cuda"
    assert devices.resolve_device("cuda") == "cuda"
    assert devices.resolve_device("cpu") == "cpu"


def test_the_synthetic_engines_decode_step_is_set_at_start(tmp_path: Path) -> None:
    repo = prepare_model_repo(MODEL_REPO / "local", tmp_path / "repo", NOTES, "cpu", synthetic_decode_us=2000)
    configs = check_repo(repo)
    assert configs["llm_synthetic"].parameters["decode_us"].string_value == "2000"
    default = check_repo(prepare_model_repo(MODEL_REPO / "local", tmp_path / "default", NOTES, "cpu"))
    assert default["llm_synthetic"].parameters["decode_us"].string_value == "20000"
