"""Fixtures for the production tooling tests: rendered repositories, tiny tokenizers and
models built offline, and the python-backend model files loaded as modules."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path
from types import ModuleType

import pytest

from gateway.deploy import MODEL_REPO
from gateway.deploy.render import render

# The required parameters of each templated profile, as a deployment would give them.
REQUIRED = {
    "trtllm": {"engine_dir": "/engines/gpt2-medium/fp16-tp1", "tokenizer_dir": "/engines/gpt2-medium/tokenizer"},
    "clip_trt": {"hf_model_dir": "/hf/clip-vit-base-patch32"},
    "llmapi": {"model": "/hf/Llama-3.1-8B-Instruct"},
}


def load_model_py(profile: str, model: str) -> ModuleType:
    """A python-backend model.py as a module (outside Triton it only offers its helpers)."""
    path = MODEL_REPO / profile / model / "1" / "model.py"
    spec = importlib.util.spec_from_file_location(f"{profile}_{model}_under_test", path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="session")
def rendered(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """Each templated profile rendered with only its required settings."""
    out = {}
    for profile, values in REQUIRED.items():
        target = tmp_path_factory.mktemp("render") / profile
        render([profile], target, settings={profile: dict(values)})
        out[profile] = target
    return out


@pytest.fixture(scope="session")
def tiny_gpt2(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from gateway.stack.weights import build_tiny_gpt2

    return build_tiny_gpt2(tmp_path_factory.mktemp("gpt2") / "tiny-gpt2")


@pytest.fixture(scope="session")
def tiny_clip(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from gateway.stack.weights import build_tiny_clip

    return build_tiny_clip(tmp_path_factory.mktemp("clip") / "tiny-clip")
