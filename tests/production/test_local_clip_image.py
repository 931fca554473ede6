"""The local CLIP image step's two paths: PIL per image (KIND_CPU) and torch for a batch (the
GPU's, here run on the CPU device; nvjpeg's JPEG decode is the GPU's own and is checked
there: docs/benchmarks.md)."""

from __future__ import annotations

import io

import numpy as np
import pytest

from .conftest import load_model_py

step = load_model_py("local", "clip_image_preprocessing")
CONFIG = {"size": {"shortest_edge": 224}, "crop_size": {"height": 224, "width": 224}}
# One 8-bit level in normalised units (the smallest std is CLIP's blue, 0.2613 of a level's 1/255).
LEVEL = 1 / 255 / 0.26130258


def _encoded(width: int, height: int, noise: bool = False, fmt: str = "PNG") -> bytes:
    from PIL import Image

    if noise:
        pixels = np.random.default_rng(width * height).integers(0, 256, size=(height, width, 3), dtype=np.uint8)
    else:  # a smooth picture, as photographs mostly are
        y, x = np.mgrid[0:height, 0:width]
        pixels = np.stack([x * 255 // width, y * 255 // height, (x + y) * 255 // (width + height)], axis=-1)
    out = io.BytesIO()
    Image.fromarray(pixels.astype(np.uint8)).save(out, format=fmt)
    return out.getvalue()


def _both(config: dict, data: bytes) -> tuple[np.ndarray, np.ndarray]:
    pil = step.ClipImageTransform(config)
    batched = step.TorchImageTransform(pil)
    return pil(data), batched.pixels(batched.decode([data]))[0].numpy()


@pytest.mark.parametrize(("width", "height"), [(640, 480), (100, 300), (30, 20), (224, 224)])
def test_the_batched_transform_matches_pil_within_one_level_on_a_smooth_picture(width: int, height: int) -> None:
    pil, batched = _both(CONFIG, _encoded(width, height))
    assert batched.shape == pil.shape == (3, 224, 224)
    assert np.abs(batched - pil).max() <= LEVEL * 1.01


def test_the_batched_transform_stays_close_to_pil_on_noise() -> None:
    # PIL rounds to 8 bits between its horizontal and vertical passes, torch does not: on
    # noise the overshoots of the bicubic filter differ, rarely and locally.
    pil, batched = _both(CONFIG, _encoded(640, 480, noise=True))
    levels = np.abs(batched - pil) / LEVEL
    assert np.quantile(levels, 0.999) <= 1.01
    assert levels.mean() < 0.25


def test_a_crop_larger_than_the_resized_picture_is_padded_as_pil_pads_it() -> None:
    config = {"size": {"shortest_edge": 224}, "crop_size": {"height": 256, "width": 256}}
    pil, batched = _both(config, _encoded(300, 240))
    assert batched.shape == pil.shape == (3, 256, 256)
    assert np.abs(batched - pil).max() <= LEVEL * 1.01


def test_pictures_of_several_sizes_in_one_batch_each_come_out_as_alone() -> None:
    batched = step.TorchImageTransform(step.ClipImageTransform(CONFIG))
    datas = [_encoded(640, 480), _encoded(100, 300), _encoded(640, 480, noise=True), _encoded(100, 300, noise=True)]
    together = batched.pixels(batched.decode(datas)).numpy()
    for data, image in zip(datas, together, strict=True):
        np.testing.assert_array_equal(image, batched.pixels(batched.decode([data]))[0].numpy())


def test_an_unreadable_picture_comes_back_as_its_error_and_the_others_are_decoded() -> None:
    batched = step.TorchImageTransform(step.ClipImageTransform(CONFIG))
    truncated = _encoded(64, 48, fmt="JPEG")[:200]
    decoded = batched.decode([_encoded(64, 48), b"not a picture", truncated, _encoded(64, 48, fmt="JPEG")])
    assert [type(image).__name__ for image in decoded] == ["Tensor", "UnidentifiedImageError", "OSError", "Tensor"]
    assert decoded[0].shape == decoded[3].shape == (3, 48, 64)
