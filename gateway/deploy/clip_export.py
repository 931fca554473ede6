"""CLIP towers -> ONNX -> TensorRT plans for model_repo/clip_trt.

The ONNX graphs contain the whole tower: encoder, projection and L2 normalisation, so a
plan's output is the final embedding and the ensembles need no extra step. Inputs are
`pixel_values` [batch, 3, S, S] float32, and `input_ids` / `attention_mask` [batch, 77]
int32 (cast to int64 inside the graph, where the embedding lookup wants it).

Plans are built with trtexec, for a batch profile 1..max_batch_size of their tower (the
render's image_max_batch_size and text_max_batch_size: 16 and 64 by default; a 64-input
embeddings call is one call of the text tower):
  fp16: trtexec --fp16 on the exported ONNX;
  int8: ModelOpt's ONNX post-training quantization inserts Q/DQ nodes calibrated on real
        images / captions (TensorRT's explicit quantization), then trtexec --int8 --fp16.
A plan only loads in the TensorRT version that built it: build on the serving machine,
in the Triton container named in engines.NGC_CONTAINER (TensorRT 10.11.0.33), or a TensorRT
container with that same TensorRT version.

torch and transformers are imported only when exporting: the rest runs anywhere.
"""

from __future__ import annotations

import importlib.util
import shutil
import sys
from dataclasses import dataclass
from pathlib import Path
from types import ModuleType
from typing import Any

import numpy as np

from gateway.deploy import MODEL_REPO, ToolError
from gateway.deploy.engines import Step

CONTEXT_LENGTH = 77
OPSET = 17
VISION_MODEL = "clip_trt_vision"
TEXT_MODEL = "clip_trt_text_encoder"
# Where TensorRT's tarball, and so trtexec, lives in NVIDIA's TensorRT-LLM based images.
TRTEXEC_CANDIDATES = ("/usr/local/tensorrt/bin/trtexec", "/usr/src/tensorrt/bin/trtexec")
IMAGE_SUFFIXES = {".jpg", ".jpeg", ".png", ".webp", ".bmp"}


def default_trtexec() -> str:
    for candidate in TRTEXEC_CANDIDATES:
        if Path(candidate).exists():
            return candidate
    return shutil.which("trtexec") or "trtexec"


def _load_model_py(model: str) -> ModuleType:
    """The python-backend model file, so calibration preprocesses exactly as serving does."""
    path = MODEL_REPO / "clip_trt" / model / "1" / "model.py"
    spec = importlib.util.spec_from_file_location(f"clip_trt_{model}", path)
    if spec is None or spec.loader is None:
        raise ToolError(f"cannot load {path}")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module


def _towers(model: Any) -> tuple[Any, Any]:
    import torch

    class VisionTower(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.encoder = model.vision_model
            self.projection = model.visual_projection

        def forward(self, pixel_values: torch.Tensor) -> torch.Tensor:
            pooled = self.encoder(pixel_values=pixel_values).pooler_output
            embeds = self.projection(pooled)
            return embeds / embeds.norm(p=2, dim=-1, keepdim=True)

    class TextTower(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.encoder = model.text_model
            self.projection = model.text_projection

        def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
            pooled = self.encoder(input_ids=input_ids.long(), attention_mask=attention_mask.long()).pooler_output
            embeds = self.projection(pooled)
            return embeds / embeds.norm(p=2, dim=-1, keepdim=True)

    return VisionTower().eval(), TextTower().eval()


@dataclass(frozen=True)
class ExportedTowers:
    vision: Path
    text: Path
    image_size: int
    embed_dim: int


def export_onnx(model_dir: str, out_dir: Path) -> ExportedTowers:
    """Export both towers of a Hugging Face CLIP (a hub id or a local folder) to ONNX."""
    import torch
    from transformers import CLIPModel

    # Eager attention exports as plain MatMul/Softmax, which every TensorRT version parses.
    model = CLIPModel.from_pretrained(model_dir, attn_implementation="eager").eval()
    image_size = int(model.config.vision_config.image_size)
    vision, text = _towers(model)
    out_dir.mkdir(parents=True, exist_ok=True)
    paths = ExportedTowers(
        out_dir / "clip_vision.onnx", out_dir / "clip_text.onnx", image_size, int(model.config.projection_dim)
    )
    batch = {0: "batch"}
    with torch.no_grad():
        torch.onnx.export(
            vision,
            (torch.zeros(2, 3, image_size, image_size),),
            str(paths.vision),
            input_names=["pixel_values"],
            output_names=["image_embeds"],
            dynamic_axes={"pixel_values": batch, "image_embeds": batch},
            opset_version=OPSET,
            dynamo=False,
        )
        ids = torch.zeros(2, CONTEXT_LENGTH, dtype=torch.int32)
        torch.onnx.export(
            text,
            (ids, torch.ones_like(ids)),
            str(paths.text),
            input_names=["input_ids", "attention_mask"],
            output_names=["text_embeds"],
            dynamic_axes={"input_ids": batch, "attention_mask": batch, "text_embeds": batch},
            opset_version=OPSET,
            dynamo=False,
        )
    return paths


def calibration_images(model_dir: Path, images_dir: Path, out: Path, limit: int = 512) -> Path:
    """pixel_values of up to `limit` images, preprocessed by the serving code, as .npz."""
    pre = _load_model_py("clip_trt_image_preprocessing")
    config = pre.load_image_config(model_dir)
    files = sorted(p for p in images_dir.rglob("*") if p.suffix.lower() in IMAGE_SUFFIXES)[:limit]
    if not files:
        raise ToolError(f"no images (.jpg, .png, ...) under {images_dir} for int8 calibration")
    pixels = np.stack([pre.preprocess_image(p.read_bytes(), config) for p in files])
    np.savez(out, pixel_values=pixels)
    return out


def calibration_texts(model_dir: Path, texts_file: Path, out: Path, limit: int = 512) -> Path:
    """input_ids and attention_mask of up to `limit` lines of text, as .npz."""
    tok = _load_model_py("clip_trt_tokenizer")
    lines = [line.strip() for line in texts_file.read_text().splitlines() if line.strip()][:limit]
    if not lines:
        raise ToolError(f"{texts_file} has no lines of text for int8 calibration")
    input_ids, attention_mask = tok.tokenize(tok.load_tokenizer(str(model_dir)), lines)
    np.savez(out, input_ids=input_ids, attention_mask=attention_mask)
    return out


def _shapes(inputs: dict[str, str], max_batch: int) -> list[str]:
    opt = max(1, max_batch // 2)
    flags = []
    for flag, batch in (("--minShapes", 1), ("--optShapes", opt), ("--maxShapes", max_batch)):
        flags.append(f"{flag}=" + ",".join(f"{name}:{batch}x{dims}" for name, dims in inputs.items()))
    return flags


def plan_steps(
    onnx: ExportedTowers,
    repo: Path,
    precision: str,
    max_batch: int,
    trtexec: str,
    vision_calib: Path | None = None,
    text_calib: Path | None = None,
    *,
    text_max_batch: int | None = None,
) -> list[Step]:
    """Commands that build both plans into a rendered clip_trt repository: the vision plan for
    batches up to max_batch, the text plan up to text_max_batch (None: max_batch too)."""
    if precision not in ("fp16", "int8"):
        raise ToolError(f"precision must be fp16 or int8, got {precision!r}")
    text_batch = max_batch if text_max_batch is None else text_max_batch
    side = onnx.image_size
    towers = [
        (VISION_MODEL, onnx.vision, {"pixel_values": f"3x{side}x{side}"}, vision_calib, max_batch),
        (
            TEXT_MODEL,
            onnx.text,
            {"input_ids": str(CONTEXT_LENGTH), "attention_mask": str(CONTEXT_LENGTH)},
            text_calib,
            text_batch,
        ),
    ]
    steps: list[Step] = []
    for model, source, inputs, calib, batch in towers:
        plan = repo / model / "1" / "model.plan"
        flags = ["--fp16"]
        if precision == "int8":
            if calib is None:
                raise ToolError(f"int8 for {model} needs calibration data (--calibration-images / --calibration-texts)")
            quantized = source.with_suffix(".int8.onnx")
            steps.append(
                Step(
                    f"{model}: insert int8 Q/DQ nodes calibrated on {calib.name} (ModelOpt)",
                    [
                        "python3",
                        "-m",
                        "modelopt.onnx.quantization",
                        "--onnx_path",
                        str(source),
                        "--quantize_mode",
                        "int8",
                        "--calibration_data_path",
                        str(calib),
                        "--calibration_method",
                        "max",
                        "--output_path",
                        str(quantized),
                    ],
                )
            )
            source = quantized
            flags = ["--int8", "--fp16"]
        steps.append(
            Step(
                f"{model}: build the TensorRT plan ({precision}, batch 1..{batch})",
                [trtexec, f"--onnx={source}", f"--saveEngine={plan}", *flags, *_shapes(inputs, batch)],
            )
        )
    return steps
