"""PNG/JPEG bytes -> CLIP pixel values.

Follows the model's preprocessor_config.json: resize the shortest side (bicubic),
centre-crop, rescale to [0, 1], normalise by mean and std, channels first.

On the CPU (KIND_CPU, as written) each image goes through PIL and numpy. On the GPU the
launcher gives this step (KIND_GPU, STACK_DEVICE=cuda): JPEGs are decoded there by nvjpeg
(torchvision's batched decode_jpeg), other formats by PIL on the CPU (nvjpeg reads no PNG),
and the resize (torch's antialiased bicubic, PIL's filter), crop and normalisation run on the
GPU, one batch per image size for all the requests Triton hands over at once.

An image whose header declares more than max_image_pixels (the config's parameter, else
MAX_IMAGE_PIXELS) is refused before it is decoded, by PIL and nvjpeg alike: a few MB of
JPEG can declare 40000x40000, which a decoder would allocate in full. The gateway refuses
it first (its MAX_IMAGE_PIXELS); this is the model's own guard."""

import io
import json
import os
from pathlib import Path

import numpy as np
from PIL import Image

try:
    import triton_python_backend_utils as pb_utils
except ImportError:  # imported by tests outside Triton
    pb_utils = None

JPEG_MAGIC = b"\xff\xd8\xff"
MAX_IMAGE_PIXELS = 50_000_000


def _side(value, key: str) -> int:
    return int(value[key] if isinstance(value, dict) else value)


class ClipImageTransform:
    def __init__(self, config: dict, max_pixels: int = MAX_IMAGE_PIXELS):
        self.max_pixels = max_pixels
        size = config.get("size", 224)
        self.resize = _side(size, "shortest_edge") if isinstance(size, dict) and "shortest_edge" in size else _side(size, "height")
        crop = config.get("crop_size", self.resize)
        self.crop = (_side(crop, "height"), _side(crop, "width"))
        self.scale = float(config.get("rescale_factor", 1 / 255))
        self.mean = np.array(config.get("image_mean", [0.48145466, 0.4578275, 0.40821073]), dtype=np.float32)
        self.std = np.array(config.get("image_std", [0.26862954, 0.26130258, 0.27577711]), dtype=np.float32)

    def resized_size(self, width: int, height: int) -> tuple[int, int]:
        ratio = self.resize / min(width, height)
        return max(1, round(width * ratio)), max(1, round(height * ratio))

    def open(self, data: bytes) -> Image.Image:
        """The image with only its header read (PIL opens lazily); ValueError when it
        declares more than max_pixels."""
        try:
            image = Image.open(io.BytesIO(data))
        except Image.DecompressionBombError as exc:  # PIL's own limit, past twice its warning
            raise ValueError(f"the image is over the limit of {self.max_pixels} pixels ({exc})") from None
        width, height = image.size
        if width * height > self.max_pixels:
            raise ValueError(f"the image is {width}x{height} pixels, over the limit of {self.max_pixels} pixels")
        return image

    def decode(self, data: bytes) -> Image.Image:
        image = self.open(data)
        image.load()  # decode now, so a truncated file fails here
        return image.convert("RGB")

    def within_limit(self, data: bytes) -> bool:
        try:
            self.open(data)
        except Exception:
            return False
        return True

    def __call__(self, data: bytes) -> np.ndarray:
        image = self.decode(data)
        image = image.resize(self.resized_size(*image.size), Image.Resampling.BICUBIC)
        width, height = image.size
        crop_h, crop_w = self.crop
        left, top = (width - crop_w) // 2, (height - crop_h) // 2
        image = image.crop((left, top, left + crop_w, top + crop_h))
        pixels = np.asarray(image, dtype=np.float32) * self.scale
        return ((pixels - self.mean) / self.std).transpose(2, 0, 1)


class TorchImageTransform:
    """ClipImageTransform's steps on a torch device, for many images at once.

    The resize is torch's antialiased bicubic (PIL's filter), rounded to whole levels as
    PIL's 8-bit resize is; a crop larger than the resized image is padded with black, as
    PIL's crop is."""

    def __init__(self, transform: ClipImageTransform, device: str = "cpu"):
        import torch

        self.torch = torch
        self.transform = transform
        self.device = torch.device(device)
        self.mean = torch.tensor(transform.mean, device=self.device).view(1, 3, 1, 1)
        self.std = torch.tensor(transform.std, device=self.device).view(1, 3, 1, 1)
        self.decode_jpegs = None
        if self.device.type == "cuda":
            try:
                from torchvision.io import ImageReadMode, decode_jpeg
            except ImportError:  # PIL decodes them too
                pass
            else:
                self.decode_jpegs = lambda datas: decode_jpeg(datas, mode=ImageReadMode.RGB, device=self.device)

    def decode(self, datas: list[bytes]) -> list:
        """Each image as uint8 [3, height, width] on the device, or the exception that
        refused it. JPEGs go to nvjpeg in one batch (where there is one); what it cannot
        read, and every other format, goes to PIL."""
        torch = self.torch
        images: list = [None] * len(datas)
        # nvjpeg allocates what a header declares: only JPEGs whose header PIL reads and whose
        # size is within the limit go there (PIL refuses the others below, saying why).
        jpegs = (
            [i for i, data in enumerate(datas) if data[:3] == JPEG_MAGIC and self.transform.within_limit(data)]
            if self.decode_jpegs
            else []
        )
        if jpegs:
            try:
                decoded = self.decode_jpegs([torch.frombuffer(bytearray(datas[i]), dtype=torch.uint8) for i in jpegs])
                for i, image in zip(jpegs, decoded):
                    images[i] = image
            except Exception:  # one nvjpeg cannot read: PIL, image by image, says which
                pass
        for i, data in enumerate(datas):
            if images[i] is None:
                try:
                    pixels = np.array(self.transform.decode(data))  # a copy torch may write
                except Exception as exc:
                    images[i] = exc
                else:
                    images[i] = torch.from_numpy(pixels).permute(2, 0, 1).to(self.device)
        return images

    def pixels(self, images: list) -> "torch.Tensor":  # noqa: F821 (torch is imported lazily)
        """uint8 [3, h, w] images -> float32 [n, 3, crop h, crop w], normalised."""
        torch = self.torch
        crop_h, crop_w = self.transform.crop
        black = (0.0 - self.mean) / self.std  # what PIL's crop pads with, normalised
        out = black.expand(len(images), 3, crop_h, crop_w).clone()
        sizes: dict[tuple[int, int], list[int]] = {}
        for i, image in enumerate(images):
            sizes.setdefault(tuple(image.shape[1:]), []).append(i)
        for (height, width), indices in sizes.items():
            new_w, new_h = self.transform.resized_size(width, height)
            batch = torch.stack([images[i] for i in indices]).float()
            batch = torch.nn.functional.interpolate(batch, size=(new_h, new_w), mode="bicubic", antialias=True, align_corners=False)
            batch = batch.round_().clamp_(0, 255)
            # the crop's window within the resized image, and where it lands in the crop
            top, left = (new_h - crop_h) // 2, (new_w - crop_w) // 2
            src_t, src_l = max(top, 0), max(left, 0)
            src_b, src_r = min(top + crop_h, new_h), min(left + crop_w, new_w)
            window = batch[:, :, src_t:src_b, src_l:src_r] * self.transform.scale
            out[indices, :, src_t - top : src_b - top, src_l - left : src_r - left] = (window - self.mean) / self.std
        return out


class TritonPythonModel:
    def initialize(self, args):
        params = json.loads(args["model_config"]).get("parameters", {})
        model_dir = Path(os.path.expandvars(params["model_dir"]["string_value"]))
        config = json.loads((model_dir / "preprocessor_config.json").read_text())
        max_pixels = int(params.get("max_image_pixels", {}).get("string_value") or MAX_IMAGE_PIXELS)
        self.transform = ClipImageTransform(config, max_pixels)
        self.on_gpu = None
        if args.get("model_instance_kind") == "GPU":
            self.on_gpu = TorchImageTransform(self.transform, f"cuda:{args['model_instance_device_id']}")

    def execute(self, requests):
        if self.on_gpu is not None:
            return self._on_gpu(requests)
        return [self._one(request) for request in requests]

    @staticmethod
    def _images(request) -> list[bytes]:
        return [bytes(data) for data in pb_utils.get_input_tensor_by_name(request, "image").as_numpy().reshape(-1)]

    @staticmethod
    def _invalid(exc: Exception):
        return pb_utils.InferenceResponse(error=pb_utils.TritonError(f"invalid image: {exc}", pb_utils.TritonError.INVALID_ARG))

    def _one(self, request):
        try:
            pixels = np.stack([self.transform(data) for data in self._images(request)])
        except Exception as exc:
            return self._invalid(exc)
        return pb_utils.InferenceResponse([pb_utils.Tensor("pixel_values", pixels)])

    def _on_gpu(self, requests):
        """Every request's images decoded and transformed together; a request with an image
        that cannot be read is refused alone."""
        per_request = [self._images(request) for request in requests]
        decoded = self.on_gpu.decode([data for images in per_request for data in images])
        responses, kept, start = [None] * len(requests), [], 0
        for r, images in enumerate(per_request):
            mine = decoded[start : start + len(images)]
            start += len(images)
            refused = next((image for image in mine if isinstance(image, Exception)), None)
            if refused is not None:
                responses[r] = self._invalid(refused)
            else:
                kept.append((r, mine))
        if kept:
            pixels = self.on_gpu.pixels([image for _, mine in kept for image in mine]).cpu().numpy()
            start = 0
            for r, mine in kept:
                responses[r] = pb_utils.InferenceResponse([pb_utils.Tensor("pixel_values", pixels[start : start + len(mine)])])
                start += len(mine)
        return responses
