"""Where the local model repository's models run: STACK_DEVICE (auto, cpu or cuda).

On cpu the repository is served as written: every model KIND_CPU in float32, Triton's
python stubs one OpenMP thread each (see triton.py). On cuda the embedding towers run
on the GPU (KIND_GPU, float16) with dynamic batching sized for it, the LLM engine puts
its model on CUDA, and the one-thread cap is lifted; the tokenizers, image decoding and
the LLM ensemble's steps stay on the CPU."""

from __future__ import annotations

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
# ensembles keep their max_batch_size of 16: the towers' dynamic batchers merge their
# requests into the larger batches.
GPU_MODELS = {
    "text_embed": GpuBatching(max_batch_size=256, preferred_batch_sizes=(64, 128, 256)),
    "clip_vision": GpuBatching(max_batch_size=128, preferred_batch_sizes=(32, 64, 128)),
    "clip_text_encoder": GpuBatching(max_batch_size=128, preferred_batch_sizes=(32, 64, 128)),
}
GPU_MAX_QUEUE_DELAY_US = 500
GPU_DTYPE = "float16"


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


def place(config: model_config_pb2.ModelConfig, device: Device) -> None:
    """Render one model's config for the device (in place)."""
    if "device" in config.parameters:  # the LLM engine places its own model
        config.parameters["device"].string_value = device
    batching = GPU_MODELS.get(config.name)
    if device != "cuda" or batching is None:
        return
    del config.instance_group[:]
    config.instance_group.add(kind=model_config_pb2.ModelInstanceGroup.KIND_GPU, count=1)
    config.max_batch_size = batching.max_batch_size
    del config.dynamic_batching.preferred_batch_size[:]
    config.dynamic_batching.preferred_batch_size.extend(batching.preferred_batch_sizes)
    config.dynamic_batching.max_queue_delay_microseconds = GPU_MAX_QUEUE_DELAY_US
    config.parameters["dtype"].string_value = GPU_DTYPE
