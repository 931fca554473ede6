"""PNG/JPEG bytes -> CLIP pixel values (PIL + numpy, no torchvision).

Follows the model's preprocessor_config.json: resize the shortest side (bicubic),
centre-crop, rescale to [0, 1], normalise by mean and std, channels first."""

import io
import json
import os
from pathlib import Path

import numpy as np
import triton_python_backend_utils as pb_utils
from PIL import Image


def _side(value, key: str) -> int:
    return int(value[key] if isinstance(value, dict) else value)


class ClipImageTransform:
    def __init__(self, config: dict):
        size = config.get("size", 224)
        self.resize = _side(size, "shortest_edge") if isinstance(size, dict) and "shortest_edge" in size else _side(size, "height")
        crop = config.get("crop_size", self.resize)
        self.crop = (_side(crop, "height"), _side(crop, "width"))
        self.scale = float(config.get("rescale_factor", 1 / 255))
        self.mean = np.array(config.get("image_mean", [0.48145466, 0.4578275, 0.40821073]), dtype=np.float32)
        self.std = np.array(config.get("image_std", [0.26862954, 0.26130258, 0.27577711]), dtype=np.float32)

    def __call__(self, data: bytes) -> np.ndarray:
        image = Image.open(io.BytesIO(data))
        image.load()  # decode now, so a truncated file fails here
        image = image.convert("RGB")
        width, height = image.size
        ratio = self.resize / min(width, height)
        image = image.resize((max(1, round(width * ratio)), max(1, round(height * ratio))), Image.Resampling.BICUBIC)
        width, height = image.size
        crop_h, crop_w = self.crop
        left, top = (width - crop_w) // 2, (height - crop_h) // 2
        image = image.crop((left, top, left + crop_w, top + crop_h))
        pixels = np.asarray(image, dtype=np.float32) * self.scale
        return ((pixels - self.mean) / self.std).transpose(2, 0, 1)


class TritonPythonModel:
    def initialize(self, args):
        params = json.loads(args["model_config"]).get("parameters", {})
        model_dir = Path(os.path.expandvars(params["model_dir"]["string_value"]))
        self.transform = ClipImageTransform(json.loads((model_dir / "preprocessor_config.json").read_text()))

    def execute(self, requests):
        return [self._one(request) for request in requests]

    def _one(self, request):
        images = pb_utils.get_input_tensor_by_name(request, "image").as_numpy().reshape(-1)
        try:
            pixels = np.stack([self.transform(bytes(data)) for data in images])
        except Exception as exc:
            return pb_utils.InferenceResponse(error=pb_utils.TritonError(f"invalid image: {exc}", pb_utils.TritonError.INVALID_ARG))
        return pb_utils.InferenceResponse([pb_utils.Tensor("pixel_values", pixels)])
