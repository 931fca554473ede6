"""Production model-repository tooling: render the Triton repositories from their
templates (render), build the TensorRT-LLM engines (engines), export CLIP to ONNX and
TensorRT plans (clip_export), write the compose file (compose), and adapt the nginx
config for local runs (nginx). The command line is `gateway model-repo ...`, or
`python -m gateway.deploy.cli ...`."""

from pathlib import Path

from gateway.assets import assets_root

# model_repo/, compose/ and nginx/: in the wheel, or beside the package in a checkout.
try:
    REPO_ROOT = assets_root()
except FileNotFoundError:
    REPO_ROOT = Path(__file__).resolve().parents[2]
MODEL_REPO = REPO_ROOT / "model_repo"


class ToolError(Exception):
    """A problem the user can fix; the command line prints it on one line and exits 2."""
