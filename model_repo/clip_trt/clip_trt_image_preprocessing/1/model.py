"""Triton python model: PNG/JPEG bytes -> CLIP pixel_values [3, S, S] float32.

Does what transformers' CLIPImageProcessor does, with PIL and numpy only (no torchvision
in the serving container): convert to RGB, resize so the short side is `shortest_edge`
(bicubic by default), centre-crop, rescale to [0, 1], normalise with the model's mean and
std. The numbers come from the model's preprocessor_config.json, old or new layout.
The helpers are plain functions so that tests and the int8 calibration of
`gateway model-repo export-clip` use exactly this code.

An image whose header declares more than MAX_IMAGE_PIXELS (or the config's parameter
max_image_pixels) is refused before it is decoded: a few MB of JPEG can declare
40000x40000, which the decoder would allocate in full. The gateway refuses it first.
"""

from __future__ import annotations

import io
import json
from pathlib import Path
from typing import Any, NamedTuple

import numpy as np

try:
    import triton_python_backend_utils as pb_utils
except ImportError:  # imported by tests or export-clip outside Triton
    pb_utils = None

MAX_IMAGE_PIXELS = 50_000_000


# A NamedTuple rather than a dataclass: Triton's stub may load this file under a module
# name that is not in sys.modules, which dataclasses need with postponed annotations.
class ImageConfig(NamedTuple):
    shortest_edge: int
    crop_height: int
    crop_width: int
    mean: tuple[float, float, float]
    std: tuple[float, float, float]
    rescale_factor: float
    resample: int


def _side(value: Any, *keys: str) -> int:
    # Old configs give a bare int; new ones {"shortest_edge": n} or {"height": h, "width": w}.
    if isinstance(value, int):
        return value
    for key in keys:
        if key in value:
            return int(value[key])
    raise ValueError(f"unsupported size entry in preprocessor_config.json: {value!r}")


def load_image_config(model_dir: str | Path) -> ImageConfig:
    raw = json.loads((Path(model_dir) / "preprocessor_config.json").read_text())
    crop = raw.get("crop_size", raw["size"])
    return ImageConfig(
        shortest_edge=_side(raw["size"], "shortest_edge", "height"),
        crop_height=_side(crop, "height", "shortest_edge"),
        crop_width=_side(crop, "width", "shortest_edge"),
        mean=tuple(raw.get("image_mean", (0.48145466, 0.4578275, 0.40821073))),
        std=tuple(raw.get("image_std", (0.26862954, 0.26130258, 0.27577711))),
        rescale_factor=float(raw.get("rescale_factor", 1 / 255)) if raw.get("do_rescale", True) else 1.0,
        resample=int(raw.get("resample", 3)),
    )


def resized_size(width: int, height: int, shortest_edge: int) -> tuple[int, int]:
    """(width, height) with the short side at shortest_edge, the long side scaled and
    truncated to an int, as transformers' get_resize_output_image_size does."""
    if width <= height:
        return shortest_edge, int(shortest_edge * height / width)
    return int(shortest_edge * width / height), shortest_edge


def preprocess_image(data: bytes, config: ImageConfig, max_pixels: int = MAX_IMAGE_PIXELS) -> np.ndarray:
    from PIL import Image

    try:
        image = Image.open(io.BytesIO(data))  # the header only: PIL decodes at load()
    except Image.DecompressionBombError as exc:  # PIL's own limit, past twice its warning
        raise ValueError(f"the image is over the limit of {max_pixels} pixels ({exc})") from None
    except Exception as exc:  # PIL raises several types for undecodable input
        raise ValueError(f"image is not a readable PNG/JPEG: {exc}") from exc
    width, height = image.size
    if width * height > max_pixels:
        raise ValueError(f"the image is {width}x{height} pixels, over the limit of {max_pixels} pixels")
    try:
        image.load()
    except Exception as exc:
        raise ValueError(f"image is not a readable PNG/JPEG: {exc}") from exc
    image = image.convert("RGB")
    image = image.resize(resized_size(*image.size, config.shortest_edge), resample=Image.Resampling(config.resample))
    pixels = np.asarray(image)
    height, width = pixels.shape[:2]
    top = (height - config.crop_height) // 2
    left = (width - config.crop_width) // 2
    if top < 0 or left < 0:
        raise ValueError("image is smaller than the crop after resizing")
    pixels = pixels[top : top + config.crop_height, left : left + config.crop_width]
    scaled = pixels.astype(np.float32) * np.float32(config.rescale_factor)
    normalised = (scaled - np.asarray(config.mean, dtype=np.float32)) / np.asarray(config.std, dtype=np.float32)
    return normalised.transpose(2, 0, 1).astype(np.float32)


def preprocess_batch(images: np.ndarray, config: ImageConfig, max_pixels: int = MAX_IMAGE_PIXELS) -> np.ndarray:
    """A [batch, 1] TYPE_STRING tensor of encoded images -> [batch, 3, H, W]."""
    rows = images.reshape(images.shape[0], -1)
    return np.stack([preprocess_image(bytes(row[0]), config, max_pixels) for row in rows])


class TritonPythonModel:
    def initialize(self, args: dict[str, str]) -> None:
        config = json.loads(args["model_config"])
        params = {key: value["string_value"] for key, value in config.get("parameters", {}).items()}
        self.config = load_image_config(params["hf_model_dir"])
        self.max_pixels = int(params.get("max_image_pixels") or MAX_IMAGE_PIXELS)
        expected = int(params["image_size"])
        if (self.config.crop_height, self.config.crop_width) != (expected, expected):
            # Fail at load time, not on the first request: the plan's input is fixed.
            raise ValueError(
                f"preprocessor_config.json crops to {self.config.crop_height}x{self.config.crop_width} "
                f"but the repository was rendered with image_size={expected}"
            )

    def execute(self, requests: list[Any]) -> list[Any]:
        responses = []
        for request in requests:
            images = pb_utils.get_input_tensor_by_name(request, "image").as_numpy()
            try:
                pixels = preprocess_batch(images, self.config, self.max_pixels)
                responses.append(pb_utils.InferenceResponse(output_tensors=[pb_utils.Tensor("pixel_values", pixels)]))
            except ValueError as exc:
                responses.append(pb_utils.InferenceResponse(error=pb_utils.TritonError(str(exc))))
        return responses
