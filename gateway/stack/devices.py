"""Where the local model repository's models run: STACK_DEVICE (auto, cpu or cuda).

On cpu the repository is served as written: every model KIND_CPU in float32, Triton's
python stubs one OpenMP thread each (see triton.py). On cuda the embedding towers run
on the GPU (KIND_GPU, float16) with dynamic batching sized for it, the LLM engine puts
its model on CUDA, and the CLIP image step decodes JPEGs and resizes on the GPU (KIND_GPU:
its model.py); the tokenizers and the LLM ensemble's steps stay on the CPU. A Python
backend instance is one process that uses 1-2.5 cores at saturation (measured on the
H100: one instance per model left the GPU at 1-4%), so on cuda each tower and the steps
that feed it get `gpu_instances` instances (about one per two cores), and each stub as
many OpenMP threads as the cores give per instance."""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Literal

from tritonclient.grpc import model_config_pb2

from gateway.stack.process import LaunchError

Device = Literal["cpu", "cuda"]


@dataclass(frozen=True)
class GpuBatching:
    max_batch_size: int
    preferred_batch_sizes: tuple[int, ...]


# The models that go to the GPU, and their batches there. The clip_image and clip_text
# ensembles keep their max_batch_size (16 and 64, as on CPU): the towers' dynamic batchers
# merge their requests into the larger batches.
GPU_MODELS = {
    "text_embed": GpuBatching(max_batch_size=256, preferred_batch_sizes=(64, 128, 256)),
    "clip_vision": GpuBatching(max_batch_size=128, preferred_batch_sizes=(32, 64, 128)),
    "clip_text_encoder": GpuBatching(max_batch_size=128, preferred_batch_sizes=(32, 64, 128)),
}
GPU_MAX_QUEUE_DELAY_US = 500
GPU_DTYPE = "float16"
# The steps that feed the towers (the CLIP ensembles' tokenizer and image decoding), and
# where they run: as many instances as the towers, or they bound them.
GPU_FEEDERS = {
    "clip_tokenizer": model_config_pb2.ModelInstanceGroup.KIND_CPU,
    "clip_image_preprocessing": model_config_pb2.ModelInstanceGroup.KIND_GPU,
}
MAX_GPU_INSTANCES = 8


def gpu_instances(cores: int | None = None) -> int:
    """Instances of each tower (and of its feeders) on cuda: one per two cores, 1 to 8."""
    cores = cores if cores is not None else os.cpu_count() or 1
    return max(1, min(MAX_GPU_INSTANCES, cores // 2))


def threads_per_instance(cores: int | None = None) -> int:
    """OpenMP threads of each Python stub on cuda: the cores shared among a tower's instances."""
    cores = cores if cores is not None else os.cpu_count() or 1
    return max(1, cores // gpu_instances(cores))


def resolve_device(setting: str) -> Device:
    """auto: cuda when torch sees a GPU, else cpu. cuda without a GPU is a LaunchError."""
    if setting == "cpu":
        return "cpu"
    try:
        import torch

        gpu = bool(torch.cuda.is_available())
    except ImportError:
        gpu = False
    if setting == "cuda" and not gpu:
        raise LaunchError("STACK_DEVICE=cuda, but torch sees no GPU: use STACK_DEVICE=cpu or auto")
    return "cuda" if gpu else "cpu"


def place(config: model_config_pb2.ModelConfig, device: Device, instances: int = 1) -> None:
    """Render one model's config for the device (in place); instances: of each tower and
    feeder on cuda (gpu_instances)."""
    if "device" in config.parameters:  # the LLM engine places its own model
        config.parameters["device"].string_value = device
    if device == "cuda" and config.name in GPU_FEEDERS:
        del config.instance_group[:]
        config.instance_group.add(kind=GPU_FEEDERS[config.name], count=instances)
    batching = GPU_MODELS.get(config.name)
    if device != "cuda" or batching is None:
        return
    del config.instance_group[:]
    config.instance_group.add(kind=model_config_pb2.ModelInstanceGroup.KIND_GPU, count=instances)
    config.max_batch_size = batching.max_batch_size
    del config.dynamic_batching.preferred_batch_size[:]
    config.dynamic_batching.preferred_batch_size.extend(batching.preferred_batch_sizes)
    config.dynamic_batching.max_queue_delay_microseconds = GPU_MAX_QUEUE_DELAY_US
    config.parameters["dtype"].string_value = GPU_DTYPE
