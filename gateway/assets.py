"""Where the repository's deployable files are (model_repo/, compose/, nginx/): named by
GATEWAY_ASSETS_DIR, else shipped inside the installed package (gateway/assets/, in a
wheel), else the checkout the package runs from (an editable install)."""

from __future__ import annotations

import os
from pathlib import Path

_PACKAGE = Path(__file__).resolve().parent


def assets_root() -> Path:
    explicit = os.environ.get("GATEWAY_ASSETS_DIR")
    if explicit:
        return Path(explicit).expanduser().resolve()
    for candidate in (_PACKAGE / "assets", _PACKAGE.parent):
        if (candidate / "model_repo").is_dir():
            return candidate
    raise FileNotFoundError("model_repo/ not found: set GATEWAY_ASSETS_DIR to a checkout of the repository")


def model_repo() -> Path:
    return assets_root() / "model_repo"
