"""`gateway model-repo ...`: render, build-engines, export-clip, compose.

Also runnable as `python -m gateway.deploy.cli ...`. A problem the user can fix is
printed on one line and exits with code 2.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from pathlib import Path
from typing import Annotated, Any, TypeVar

import typer

from gateway.deploy import ToolError
from gateway.deploy.engines import NGC_CONTAINER, TRTLLM_VERSION

app = typer.Typer(help="Production model repositories, engines and deployment files.", no_args_is_help=True)

F = TypeVar("F", bound=Callable[..., Any])


def _friendly(func: F) -> F:
    @functools.wraps(func)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        try:
            return func(*args, **kwargs)
        except ToolError as exc:
            typer.echo(f"error: {exc}", err=True)
            raise typer.Exit(2) from None

    return wrapper  # type: ignore[return-value]


@app.command()
@_friendly
def render(
    out: Annotated[Path, typer.Option("--out", "-o", help="Folder to write the model repository to.")],
    profile: Annotated[
        list[str] | None,
        typer.Option("--profile", "-p", help="local, trtllm, clip_trt or llmapi; repeat to combine."),
    ] = None,
    settings: Annotated[
        Path | None, typer.Option("--settings", "-s", help="TOML file with a [profile] table of parameters.")
    ] = None,
    set_: Annotated[
        list[str] | None, typer.Option("--set", help="profile.key=value, overriding the settings file.")
    ] = None,
    engine_dir: Annotated[
        Path | None,
        typer.Option(help="The trtllm engine folder as this machine sees it, to check its config.json."),
    ] = None,
    force: Annotated[bool, typer.Option(help="Replace an earlier render in --out.")] = False,
    llmapi_source: Annotated[
        Path | None,
        typer.Option(
            help="llmapi: the folder with TensorRT-LLM's model.py and helpers.py "
            "(triton_backend/all_models/llmapi/tensorrt_llm/1 of the container's version), copied in."
        ),
    ] = None,
) -> None:
    """Fill the templates of model_repo/<profile> and write a checked model repository."""
    from gateway.deploy import render as r

    result = r.render(
        profiles=list(profile or []),
        out=out,
        settings=r.load_settings(settings),
        sets=r.parse_sets(list(set_ or [])),
        engine_dir=engine_dir,
        force=force,
        llmapi_source=llmapi_source,
    )
    for note in result.notes:
        typer.echo(note)
    typer.echo(f"wrote {len(result.models)} models to {result.out}: {', '.join(result.models)}")


@app.command(
    "build-engines",
    help=(
        "Download gpt2-medium, convert and quantize it, and build its TensorRT-LLM engine. "
        f"Run inside {NGC_CONTAINER} (TensorRT-LLM {TRTLLM_VERSION}); --dry-run prints every command."
    ),
)
@_friendly
def build_engines(
    workdir: Annotated[Path, typer.Option(help="Scratch space: TensorRT-LLM examples, weights, checkpoints.")] = Path(
        "/workspace/build"
    ),
    engines_dir: Annotated[Path, typer.Option(help="Where engines are served from (mounted at /engines).")] = Path(
        "/engines"
    ),
    quantization: Annotated[str, typer.Option(help="fp16, int8_wo, int8_sq, int4_awq or fp8.")] = "fp16",
    tp_size: Annotated[int, typer.Option(help="Tensor-parallel size: GPUs per engine.")] = 1,
    max_batch_size: Annotated[int, typer.Option()] = 64,
    max_input_len: Annotated[int, typer.Option()] = 768,
    max_seq_len: Annotated[int, typer.Option(help="Prompt + output; gpt2-medium has 1024 positions.")] = 1024,
    max_num_tokens: Annotated[int, typer.Option()] = 8192,
    check_version: Annotated[
        bool, typer.Option(help="Refuse to run in a container without the pinned TensorRT-LLM.")
    ] = True,
    dry_run: Annotated[bool, typer.Option("--dry-run", help="Print every command without running it.")] = False,
) -> None:
    from gateway.deploy import engines as e

    try:
        quant = e.Quantization(quantization)
    except ValueError:
        raise ToolError(
            f"--quantization {quantization!r}: choose one of {', '.join(q.value for q in e.Quantization)}"
        ) from None
    settings = e.BuildSettings(
        workdir=workdir,
        engines_dir=engines_dir,
        quantization=quant,
        tp_size=tp_size,
        max_batch_size=max_batch_size,
        max_input_len=max_input_len,
        max_seq_len=max_seq_len,
        max_num_tokens=max_num_tokens,
    )
    typer.echo(f"# TensorRT-LLM {e.TRTLLM_VERSION} in {e.NGC_CONTAINER}")
    e.run(e.plan(settings, check_version=check_version), dry_run=dry_run)
    typer.echo("# render settings for this engine (paths as the compose file mounts them):")
    typer.echo("\n".join(f"#   {line}" for line in e.render_settings(settings).splitlines()))


@app.command("export-clip")
@_friendly
def export_clip(
    repo: Annotated[Path, typer.Option(help="Rendered clip_trt repository; plans go to <model>/1/model.plan.")],
    model: Annotated[str, typer.Option(help="Hugging Face CLIP id or folder.")] = "openai/clip-vit-base-patch32",
    onnx_dir: Annotated[Path, typer.Option(help="Where the ONNX files and calibration data go.")] = Path(
        "build/clip-onnx"
    ),
    precision: Annotated[str, typer.Option(help="fp16 or int8.")] = "fp16",
    image_max_batch_size: Annotated[
        int, typer.Option(help="Largest batch of the vision plan (render's image_max_batch_size).")
    ] = 16,
    text_max_batch_size: Annotated[
        int, typer.Option(help="Largest batch of the text plan (render's text_max_batch_size).")
    ] = 64,
    calibration_images: Annotated[Path | None, typer.Option(help="int8: folder of representative images.")] = None,
    calibration_texts: Annotated[Path | None, typer.Option(help="int8: text file, one caption per line.")] = None,
    trtexec: Annotated[str | None, typer.Option(help="trtexec binary (default: TensorRT's, else PATH).")] = None,
    onnx_only: Annotated[bool, typer.Option(help="Stop after the ONNX export.")] = False,
    dry_run: Annotated[bool, typer.Option("--dry-run", help="Print the plan-building commands only.")] = False,
) -> None:
    """Export the CLIP vision and text towers to ONNX and build their TensorRT plans."""
    from gateway.deploy import clip_export as c
    from gateway.deploy import engines as e

    if dry_run:
        # The shapes come from the model; without exporting, assume the ViT-B/32 family's.
        towers = c.ExportedTowers(onnx_dir / "clip_vision.onnx", onnx_dir / "clip_text.onnx", 224, 512)
        typer.echo(f"# would export {model} to {towers.vision} and {towers.text} (image size assumed 224)")
    else:
        towers = c.export_onnx(model, onnx_dir)
        typer.echo(f"exported {towers.vision} and {towers.text} (image {towers.image_size}, dim {towers.embed_dim})")
        typer.echo(f"render clip_trt with image_size = {towers.image_size} and embed_dim = {towers.embed_dim}")
        if onnx_only:
            return
    vision_calib = text_calib = None
    if precision == "int8":
        if calibration_images is None or calibration_texts is None:
            raise ToolError("--precision int8 needs --calibration-images and --calibration-texts")
        vision_calib, text_calib = onnx_dir / "calib_vision.npz", onnx_dir / "calib_text.npz"
        if not dry_run:
            local = _local_model_dir(model)
            c.calibration_images(local, calibration_images, vision_calib)
            c.calibration_texts(local, calibration_texts, text_calib)
    steps = c.plan_steps(
        towers,
        repo,
        precision,
        image_max_batch_size,
        trtexec or c.default_trtexec(),
        vision_calib,
        text_calib,
        text_max_batch=text_max_batch_size,
    )
    e.run(steps, dry_run=dry_run)


def _local_model_dir(model: str) -> Path:
    if Path(model).is_dir():
        return Path(model)
    from huggingface_hub import snapshot_download

    return Path(snapshot_download(model, allow_patterns=["*.json", "*.txt"]))


@app.command()
@_friendly
def compose(
    deployment: Annotated[Path | None, typer.Option(help="Default: compose/deployment.toml.")] = None,
    out: Annotated[Path | None, typer.Option(help="Default: compose/docker-compose.yml.")] = None,
    check: Annotated[bool, typer.Option(help="Only report whether the file is up to date (exit 1 if not).")] = False,
) -> None:
    """Write docker-compose.yml for the GPUs and replica counts of deployment.toml."""
    from gateway.deploy import compose as cmp

    deployment = deployment or cmp.DEPLOYMENT_FILE
    out = out or cmp.COMPOSE_FILE
    text = cmp.dump(cmp.Deployment.load(deployment))
    if check:
        if not out.exists() or out.read_text() != text:
            typer.echo(f"{out} is out of date with {deployment}: run `gateway model-repo compose`", err=True)
            raise typer.Exit(1)
        typer.echo(f"{out} is up to date")
        return
    out.write_text(text)
    typer.echo(f"wrote {out}")


def main() -> None:
    app()


if __name__ == "__main__":
    main()
