"""CLIP on GPU: the python preprocessing steps, the ONNX export, and the trtexec plans."""

from __future__ import annotations

import io
import json
from pathlib import Path

import numpy as np
import pytest
from typer.testing import CliRunner

from gateway.deploy.cli import app
from gateway.deploy.clip_export import ExportedTowers, plan_steps

from .conftest import load_model_py

image_pre = load_model_py("clip_trt", "clip_trt_image_preprocessing")
text_pre = load_model_py("clip_trt", "clip_trt_tokenizer")


def _png(width: int, height: int, seed: int = 0) -> bytes:
    from PIL import Image

    pixels = np.random.default_rng(seed).integers(0, 256, size=(height, width, 3), dtype=np.uint8)
    buffer = io.BytesIO()
    Image.fromarray(pixels).save(buffer, format="PNG")
    return buffer.getvalue()


@pytest.mark.parametrize(("width", "height"), [(70, 50), (40, 90), (32, 32)])
def test_image_preprocessing_matches_transformers(tiny_clip: Path, width: int, height: int) -> None:
    from PIL import Image
    from transformers import CLIPImageProcessorPil

    data = _png(width, height)
    ours = image_pre.preprocess_image(data, image_pre.load_image_config(tiny_clip))
    reference = CLIPImageProcessorPil.from_pretrained(tiny_clip)(
        images=Image.open(io.BytesIO(data)), return_tensors="np"
    )
    assert ours.dtype == np.float32
    assert ours.shape == reference["pixel_values"][0].shape
    np.testing.assert_allclose(ours, reference["pixel_values"][0], atol=1e-5)


def test_old_style_preprocessor_config_is_read(tmp_path: Path) -> None:
    # openai/clip-vit-base-patch32 still ships the old layout with bare ints.
    (tmp_path / "preprocessor_config.json").write_text(
        json.dumps(
            {
                "crop_size": 224,
                "size": 224,
                "do_center_crop": True,
                "do_normalize": True,
                "do_resize": True,
                "image_mean": [0.5, 0.5, 0.5],
                "image_std": [0.25, 0.25, 0.25],
                "resample": 3,
            }
        )
    )
    config = image_pre.load_image_config(tmp_path)
    assert (config.shortest_edge, config.crop_height, config.crop_width) == (224, 224, 224)
    assert config.rescale_factor == pytest.approx(1 / 255)
    assert image_pre.preprocess_image(_png(300, 240), config).shape == (3, 224, 224)


def test_undecodable_image_is_a_clear_error(tiny_clip: Path) -> None:
    with pytest.raises(ValueError, match="not a readable PNG/JPEG"):
        image_pre.preprocess_image(b"not an image", image_pre.load_image_config(tiny_clip))


def test_text_is_tokenized_to_77_int32_positions(tiny_clip: Path) -> None:
    tokenizer = text_pre.load_tokenizer(str(tiny_clip))
    texts = text_pre.texts_of(np.array([[b"a cat"], [b"a kitten rests on a rug " * 30]], dtype=object))
    ids, mask = text_pre.tokenize(tokenizer, texts)
    assert ids.shape == mask.shape == (2, 77)
    assert ids.dtype == mask.dtype == np.int32
    assert mask[0].sum() == len(tokenizer("a cat")["input_ids"])
    assert mask[1].all()


def test_onnx_towers_give_the_torch_embeddings_normalised(tiny_clip: Path, tmp_path: Path) -> None:
    pytest.importorskip("onnx")
    ort = pytest.importorskip("onnxruntime")
    import torch
    from transformers import CLIPModel

    from gateway.deploy.clip_export import export_onnx

    towers = export_onnx(str(tiny_clip), tmp_path)
    config = image_pre.load_image_config(tiny_clip)
    pixels = np.stack([image_pre.preprocess_image(_png(60, 45, seed), config) for seed in range(3)])
    ids, mask = text_pre.tokenize(text_pre.load_tokenizer(str(tiny_clip)), ["a cat", "a rug", "stock markets"])

    image = ort.InferenceSession(str(towers.vision)).run(None, {"pixel_values": pixels})[0]
    text = ort.InferenceSession(str(towers.text)).run(None, {"input_ids": ids, "attention_mask": mask})[0]

    model = CLIPModel.from_pretrained(tiny_clip, attn_implementation="eager").eval()
    with torch.no_grad():
        out = model(
            input_ids=torch.from_numpy(ids).long(),
            attention_mask=torch.from_numpy(mask).long(),
            pixel_values=torch.from_numpy(pixels),
        )
    np.testing.assert_allclose(image, out.image_embeds.numpy(), atol=1e-4)
    np.testing.assert_allclose(text, out.text_embeds.numpy(), atol=1e-4)
    np.testing.assert_allclose(np.linalg.norm(image, axis=1), 1.0, atol=1e-5)
    assert towers.embed_dim == image.shape[1] == text.shape[1]


def _towers(tmp_path: Path) -> ExportedTowers:
    return ExportedTowers(tmp_path / "v.onnx", tmp_path / "t.onnx", 224, 512)


def test_fp16_plans_are_built_into_the_repository_with_a_batch_profile(tmp_path: Path) -> None:
    steps = plan_steps(_towers(tmp_path), tmp_path / "repo", "fp16", 16, "trtexec")
    vision, text = (step.argv for step in steps)
    assert vision[:3] == [
        "trtexec",
        f"--onnx={tmp_path / 'v.onnx'}",
        f"--saveEngine={tmp_path / 'repo/clip_trt_vision/1/model.plan'}",
    ]
    assert "--fp16" in vision and "--int8" not in vision
    assert "--minShapes=pixel_values:1x3x224x224" in vision
    assert "--maxShapes=pixel_values:16x3x224x224" in vision
    assert "--maxShapes=input_ids:16x77,attention_mask:16x77" in text
    assert f"--saveEngine={tmp_path / 'repo/clip_trt_text_encoder/1/model.plan'}" in text


def test_int8_plans_are_calibrated_with_modelopt_first(tmp_path: Path) -> None:
    steps = plan_steps(
        _towers(tmp_path),
        tmp_path / "repo",
        "int8",
        16,
        "trtexec",
        tmp_path / "calib_vision.npz",
        tmp_path / "calib_text.npz",
    )
    assert len(steps) == 4
    quantize, build = steps[0].argv, steps[1].argv
    assert quantize[:3] == ["python3", "-m", "modelopt.onnx.quantization"]
    assert quantize[5:7] == ["--quantize_mode", "int8"]
    assert str(tmp_path / "calib_vision.npz") in quantize
    assert f"--onnx={tmp_path / 'v.int8.onnx'}" in build
    assert "--int8" in build and "--fp16" in build


def test_int8_without_calibration_data_is_refused() -> None:
    result = CliRunner().invoke(app, ["export-clip", "--repo", "/tmp/r", "--precision", "int8", "--dry-run"])
    assert result.exit_code == 2
    assert "--calibration-images" in result.output


def test_calibration_data_uses_the_serving_preprocessing(tiny_clip: Path, tmp_path: Path) -> None:
    from gateway.deploy.clip_export import calibration_images, calibration_texts

    images = tmp_path / "images"
    images.mkdir()
    for seed in range(3):
        (images / f"{seed}.png").write_bytes(_png(50 + seed, 40, seed))
    texts = tmp_path / "captions.txt"
    texts.write_text("a cat\n\na rug\n")
    vision = np.load(calibration_images(tiny_clip, images, tmp_path / "v.npz"))
    text = np.load(calibration_texts(tiny_clip, texts, tmp_path / "t.npz"))
    assert vision["pixel_values"].shape == (3, 3, 32, 32)
    config = image_pre.load_image_config(tiny_clip)
    np.testing.assert_array_equal(
        vision["pixel_values"][0], image_pre.preprocess_image((images / "0.png").read_bytes(), config)
    )
    assert text["input_ids"].shape == text["attention_mask"].shape == (2, 77)
