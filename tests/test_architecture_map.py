"""docs/architecture.md names only what exists: every module and folder it names (in backticks,
or a path with a source file's ending in its text) is in the repository's tree, and every bench
it names (`bench.X`, `bench/X.py`) is a module of bench/. A room renamed or a module moved
fails here until the map says where it went."""

from __future__ import annotations

import os
import re
import subprocess
from functools import cache
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
MAP = ROOT / "docs" / "architecture.md"

_TICKED = re.compile(r"`([^`\n]+)`")
# A path in the prose: words joined by slashes, ending in a source file's ending.
_PLAIN = re.compile(r"(?<![\w/.`-])([\w-]+(?:/[\w.-]+)+\.(?:py|lua|md|sh|toml))\b")
_PATHLIKE = re.compile(r"[\w.-]+(?:/[\w.-]+)*/?")
_BENCH = re.compile(r"\bbench\.(\w+)")


def named_paths(text: str) -> set[str]:
    """The modules and folders a text names: the backticked spans that are paths (a folder
    ends with a slash; an API route, starting with one, is not a path) and the source paths
    in its prose."""
    ticked = {
        span
        for span in _TICKED.findall(text)
        if _PATHLIKE.fullmatch(span) and ("/" in span or span.endswith(".py")) and not span.startswith("/")
    }
    return ticked | set(_PLAIN.findall(text))


def named_benches(text: str) -> set[str]:
    """The bench modules a text names, as `bench.X` or as a path under bench/."""
    paths = {p.removeprefix("bench/").removesuffix(".py") for p in named_paths(text) if p.startswith("bench/")}
    return set(_BENCH.findall(text)) | {p for p in paths if "/" not in p}


@cache
def tree() -> tuple[str, ...]:
    """The repository's files (tracked, and untracked ones git does not ignore), relative to
    its root; every file below the root but hidden folders where git is not there."""
    try:
        listed = subprocess.run(
            ["git", "ls-files", "--cached", "--others", "--exclude-standard"],
            cwd=ROOT,
            capture_output=True,
            text=True,
            check=True,
        ).stdout.splitlines()
    except (OSError, subprocess.CalledProcessError):
        listed = []
        for folder, dirs, files in os.walk(ROOT):
            dirs[:] = [d for d in dirs if not d.startswith(".") and d != "node_modules"]
            listed += [str(Path(folder, f).relative_to(ROOT)) for f in files]
    return tuple(sorted(listed))


def exists(path: str, files: tuple[str, ...]) -> bool:
    """Whether a file ends with the path (a folder: a file lies inside a folder of that
    name), matched at a path segment's start."""
    if path.endswith("/"):
        return any(f.startswith(path) or f"/{path}" in f for f in files)
    return any(f == path or f.endswith(f"/{path}") for f in files)


def missing(text: str, files: tuple[str, ...]) -> list[str]:
    names = named_paths(text) | {f"bench/{b}.py" for b in named_benches(text)}
    return sorted(p for p in names if not exists(p, files))


# ---- the rules, on texts of the test's own -------------------------------------------------

FILES = ("gateway/server/spine.py", "gateway/server/results/reader.py", "bench/edge_floor.py", "README.md")


def test_a_named_module_found_by_its_path_suffix_passes() -> None:
    assert missing("the spine (`gateway/server/spine.py`), the reader (`results/reader.py`)", FILES) == []


def test_a_module_gone_is_reported() -> None:
    assert missing("the runner (`dispatch/runner.py`)", FILES) == ["dispatch/runner.py"]


def test_a_folder_is_a_folder_of_some_file() -> None:
    assert missing("`results/` and `server/`", FILES) == []
    assert missing("`dispatch/`", FILES) == ["dispatch/"]


def test_a_suffix_counts_only_at_a_segment_start() -> None:
    assert missing("`eader.py`, `ults/`", FILES) == ["eader.py", "ults/"]


def test_a_path_in_the_prose_is_checked_too() -> None:
    assert missing("as gateway/server/dispatch/leases.py says", FILES) == ["gateway/server/dispatch/leases.py"]


def test_a_bench_named_as_a_module_must_be_one() -> None:
    assert missing("`python -m bench.edge_floor`; bench.cluster_bench", FILES) == ["bench/cluster_bench.py"]


def test_routes_and_key_patterns_are_not_paths() -> None:
    text = "`POST /infer`, `/v1/responses/compact`, `GET /results/<id>`, `q:<model>:<band>:<tenant>`, `{s3}:…`"
    assert named_paths(text) == set()


# ---- the map itself --------------------------------------------------------------------------


@pytest.fixture(scope="module")
def the_map() -> str:
    return MAP.read_text(encoding="utf-8")


def test_every_module_and_folder_the_map_names_exists(the_map: str) -> None:
    assert missing(the_map, tree()) == []


def test_the_map_names_its_rooms_and_benches(the_map: str) -> None:
    # (so that the check above has something to check)
    names = named_paths(the_map)
    assert {"gateway/server/spine.py", "dispatch/runner.py", "results/"} <= names
    assert "cluster_bench" in named_benches(the_map)
    assert "footprint" in named_benches(the_map)  # the count of files a request runs through
