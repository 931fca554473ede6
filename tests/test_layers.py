"""The layout the code promises (docs/architecture.md), checked on its source: the spine
is the only caller of the script layer's writes, no import circle in gateway/, no room below the
HTTP layers imports them, no API door imports another (nor their core a door), and every key a
Lua script knows before it runs arrives in KEYS."""

from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest

from gateway.server.queue import scripts

PACKAGE = Path(__file__).resolve().parent.parent / "gateway"

# JobStore's calls that change a request's state: the spine's alone. Its reads (read, load,
# load_many, queue_position, final_record, record_at, waiting, follow: a notice flag, no
# state) change nothing and are called by the readers themselves (docs/architecture.md).
SCRIPT_LAYER_CALLS = {
    "submit",
    "take",
    "take_many",
    "emit",
    "emit_many",
    "renew",
    "reclaim",
    "handover",
    "finish",
    "cancel",
}

LOWER_ROOMS = ("queue", "dispatch", "results", "search", "models", "routing", "tenants", "llm", "replicas")


def _modules() -> dict[str, Path]:
    """Every module of the package by its dotted name (a package by its own name)."""
    modules = {}
    for path in PACKAGE.rglob("*.py"):
        parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
        modules[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    return modules


def _imports(name: str, path: Path, modules: dict[str, Path]) -> set[str]:
    """The gateway modules `name` imports, at the top, in functions or under TYPE_CHECKING."""
    base = name.split(".") if path.name == "__init__.py" else name.split(".")[:-1]
    found: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text())):
        targets: list[str] = []
        if isinstance(node, ast.Import):
            targets = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            prefix = node.module or ""
            if node.level:
                prefix = ".".join(base[: len(base) - node.level + 1] + ([node.module] if node.module else []))
            targets = [prefix] + [f"{prefix}.{alias.name}" for alias in node.names]
        for target in targets:
            while target and target not in modules:
                target = target.rpartition(".")[0]
            if target and target != name:
                found.add(target)
    return found


def test_only_the_spine_changes_a_requests_state() -> None:
    callers = []
    for name, path in _modules().items():
        if name == "gateway.server.spine" or name.startswith("gateway.server.queue"):
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            if (
                isinstance(node, ast.Call)
                and isinstance(node.func, ast.Attribute)
                and node.func.attr in SCRIPT_LAYER_CALLS
                and ast.unparse(node.func.value).endswith("jobs")
            ):
                callers.append(f"{name}:{node.lineno} {ast.unparse(node.func)}")
    assert callers == []


FORWARDS_ALLOWED: set[str] = set()


def test_no_spine_function_only_forwards_to_the_job_store() -> None:
    forwards = []
    for node in ast.parse((PACKAGE / "server" / "spine.py").read_text()).body:
        if not isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            continue
        body = [s for s in node.body if not (isinstance(s, ast.Expr) and isinstance(s.value, ast.Constant))]
        if len(body) != 1 or not isinstance(body[0], (ast.Return, ast.Expr)) or body[0].value is None:
            continue
        call = body[0].value.value if isinstance(body[0].value, ast.Await) else body[0].value
        if (
            isinstance(call, ast.Call)
            and isinstance(call.func, ast.Attribute)
            and ast.unparse(call.func.value).endswith("jobs")
        ):
            forwards.append(node.name)
    assert sorted(forwards) == sorted(FORWARDS_ALLOWED)


def test_no_module_imports_the_scripts_but_the_script_layer_and_the_spine() -> None:
    importers = {
        name
        for name, path in _modules().items()
        if "gateway.server.queue.scripts" in _imports(name, path, _modules())
        and name != "gateway.server.queue.jobs"
        and not name.startswith("gateway.server.queue.scripts.")  # the package's own modules
    }
    # The lease keeper runs RENEW from its own thread, on a synchronous connection, through
    # spine.keep_leases (which registers the script there).
    assert importers == {"gateway.server.spine"}


def test_there_is_no_import_circle_in_the_gateway_package() -> None:
    modules = _modules()
    graph = {name: _imports(name, path, modules) for name, path in modules.items()}
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    circles: list[list[str]] = []

    def visit(v: str) -> None:  # Tarjan's strongly connected components
        index[v] = low[v] = len(index)
        stack.append(v)
        for w in graph[v]:
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                circles.append(sorted(component))

    for name in graph:
        if name not in index:
            visit(name)
    assert circles == []


@pytest.mark.parametrize("room", LOWER_ROOMS)
def test_a_room_below_the_http_layers_does_not_import_them(room: str) -> None:
    modules = _modules()
    upward = [
        f"{name} -> {target}"
        for name, path in modules.items()
        if name.startswith(f"gateway.server.{room}")
        for target in _imports(name, path, modules)
        if target.startswith(("gateway.server.api", "gateway.server.openai"))
    ]
    assert upward == []


# The API doors: each maps its API's shapes onto the core (gateway.server.calls), and none
# imports another (a third API would otherwise import /v1 again).
DOORS = ("gateway.server.openai", "gateway.server.anthropic")


def _door_of(name: str) -> str | None:
    return next((door for door in DOORS if name == door or name.startswith(f"{door}.")), None)


@pytest.mark.parametrize("door", DOORS)
def test_a_door_imports_no_other_door(door: str) -> None:
    modules = _modules()
    across = [
        f"{name} -> {target}"
        for name, path in modules.items()
        if _door_of(name) == door
        for target in _imports(name, path, modules)
        if _door_of(target) not in (None, door)
    ]
    assert across == []


def test_the_core_of_the_doors_imports_no_door() -> None:
    modules = _modules()
    upward = [
        f"{name} -> {target}"
        for name, path in modules.items()
        if name.startswith("gateway.server.calls")
        for target in _imports(name, path, modules)
        if _door_of(target) is not None
    ]
    assert upward == []


# The keys the scripts can only find as they run (docs/deployment.md, moving a slot): the
# request TAKE starts (and the tenant it picks), the requests RECLAIM finds due, the
# reclaimed list of a request's model read from its hash, the ready sets a finishing run
# unblocks, a queued request's standing. Anything else a script touches arrives in KEYS.
FOUND_AS_THEY_RUN = sorted(
    [
        "LLEN P .. 'q:' .. mb .. ':' .. tenant",  # unblock
        "ZADD P .. 'ready:' .. mb",  # unblock
        "GET P .. 'tokens:' .. rid",  # TAKE (and its replay)
        "XADD P .. 'events:' .. rid",  # TAKE
        "HMGET P .. 'req:' .. rid",  # TAKE, a reclaimed request
        "SADD P .. 'blocked:' .. t",  # TAKE, a tenant at its limit
        "HGET P .. 'req:' .. rid",  # TAKE, the picked request
        "RPUSH P .. 'reclaimed:' .. h[2]",  # RECLAIM
        "RPUSH P .. 'reclaimed:' .. h[2]",  # HANDOVER
        "LLEN P .. 'reclaimed:' .. model",  # standing
        "ZCARD P .. 'ready:' .. model .. ':' .. higher",  # standing
        "LPOS P .. 'q:' .. mb .. ':' .. tenant",  # standing
    ]
)


def test_every_key_a_script_knows_before_it_runs_arrives_in_keys() -> None:
    built = []
    for script in (value for name, value in vars(scripts).items() if name.isupper() or name.startswith("_")):
        if not isinstance(script, str):
            continue
        for command, key in re.findall(r"redis\.call\(\s*'(\w+)'\s*,\s*([^,)]*)", script):
            if ".." in key and command not in ("PUBLISH", "SPUBLISH"):
                built.append(f"{command} {key.strip()}")
    # Each script string repeats the shared parts it is made of: count each call once.
    source = "".join(path.read_text() for path in sorted(Path(scripts.__file__).parent.glob("*.py")))
    in_source = [
        f"{command} {key.strip()}"
        for command, key in re.findall(r"redis\.call\(\s*'(\w+)'\s*,\s*([^,)]*)", source)
        if ".." in key and command not in ("PUBLISH", "SPUBLISH")
    ]
    assert set(built) == set(in_source)
    assert sorted(in_source) == FOUND_AS_THEY_RUN
