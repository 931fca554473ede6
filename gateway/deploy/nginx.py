"""Run the production nginx/nginx.conf locally, without root: for `nginx -t` in CI and for
end-to-end tests through nginx.

localize() rewrites only what must differ on a test machine: listen addresses, upstream
servers, and the pid, log and temp paths (which default to system folders). Everything
else (balancing, SSE settings, limits, error pages) is tested as it ships. Each rewrite
must match exactly once, so a change to nginx.conf that breaks it fails loudly here.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
from pathlib import Path

from gateway.deploy import REPO_ROOT, ToolError

NGINX_CONF = REPO_ROOT / "nginx" / "nginx.conf"
GET_NGINX = REPO_ROOT / "tools" / "get_nginx.sh"
EXTRACTED_NGINX = REPO_ROOT / ".venv" / "nginx" / "usr" / "sbin" / "nginx"
_TEMP_KINDS = ("client_body", "proxy", "fastcgi", "uwsgi", "scgi")


def _sub_once(pattern: str, replacement: str, text: str, what: str) -> str:
    new, count = re.subn(pattern, lambda _: replacement, text, flags=re.MULTILINE | re.DOTALL)
    if count != 1:
        raise ToolError(f"nginx.conf: expected exactly one {what}, found {count}; update gateway/deploy/nginx.py")
    return new


def _servers(text: str, upstream: str, servers: list[str]) -> str:
    """Replace the `server` lines of one upstream block, keeping its other directives."""
    if not servers:
        raise ToolError(f"upstream {upstream}: at least one server is needed")
    match = re.search(rf"^(\s*)upstream {upstream} \{{\n(.*?)^\1\}}", text, flags=re.MULTILINE | re.DOTALL)
    if match is None:
        raise ToolError(f"nginx.conf: upstream {upstream} not found; update gateway/deploy/nginx.py")
    indent = match.group(1) + "    "
    body_lines = match.group(2).splitlines()
    first = next((i for i, line in enumerate(body_lines) if line.strip().startswith("server ")), None)
    if first is None:
        raise ToolError(f"nginx.conf: upstream {upstream} has no server line")
    kept = [line for line in body_lines if not line.strip().startswith("server ")]
    new_lines = kept[:first] + [f"{indent}server {s};" for s in servers] + kept[first:]
    start, end = match.span(2)
    return text[:start] + "\n".join(new_lines) + "\n" + text[end:]


def localize(
    conf: str,
    *,
    workdir: Path,
    http_port: int,
    gateways: list[str],
    grpc_port: int | None = None,
    tritons: list[str] | None = None,
    host: str = "127.0.0.1",
) -> str:
    """nginx.conf for a local run: listens on host:http_port (and host:grpc_port for the
    Triton gRPC block, which is dropped when tritons is None), sends to the given
    `host:port` servers, and keeps every file under workdir."""
    tmp = workdir / "tmp"
    text = _sub_once(r"^pid [^;]+;$", f"pid {workdir}/nginx.pid;", conf, "pid directive")
    text = _sub_once(r"^error_log [^;]+;$", f"error_log {workdir}/error.log info;", text, "error_log directive")
    text = _sub_once(
        r"access_log /dev/stdout upstream;",
        f"access_log {workdir}/access.log upstream;",
        text,
        "access_log to /dev/stdout",
    )
    temp_paths = "".join(f"\n    {kind}_temp_path {tmp}/{kind};" for kind in _TEMP_KINDS)
    text = _sub_once(r"^http \{$", "http {" + temp_paths, text, "http block")
    text = _servers(text, "gateways", gateways)
    text = _sub_once(r"^(\s*)listen 80;$", f"        listen {host}:{http_port};", text, "listen 80")
    if tritons is None:
        text = _sub_once(
            r"^\s*# BEGIN optional triton-grpc$.*?# END optional triton-grpc$\n", "", text, "optional triton-grpc block"
        )
    else:
        if grpc_port is None:
            raise ToolError("grpc_port is needed with tritons")
        text = _servers(text, "tritons", tritons)
        text = _sub_once(
            r"^(\s*)listen 8001 http2;$", f"        listen {host}:{grpc_port} http2;", text, "listen 8001 http2"
        )
    if os.geteuid() == 0:
        # As root the workers would switch to `nobody`, who cannot write workdir's temp files.
        text = "user root;\n" + text
    return text


def write_local_conf(workdir: Path, **kwargs: object) -> Path:
    """localize() the shipped nginx.conf into workdir/nginx.conf, with its folders made."""
    for kind in _TEMP_KINDS:
        (workdir / "tmp" / kind).mkdir(parents=True, exist_ok=True)
    conf = workdir / "nginx.conf"
    conf.write_text(localize(NGINX_CONF.read_text(), workdir=workdir, **kwargs))  # type: ignore[arg-type]
    return conf


def find_nginx() -> Path | None:
    """$NGINX_BIN, else nginx on PATH, else the one tools/get_nginx.sh extracts."""
    for candidate in (os.environ.get("NGINX_BIN"), shutil.which("nginx"), str(EXTRACTED_NGINX)):
        if candidate and Path(candidate).is_file() and os.access(candidate, os.X_OK):
            return Path(candidate)
    return None


def ensure_nginx() -> Path:
    found = find_nginx()
    if found is not None:
        return found
    result = subprocess.run(["bash", str(GET_NGINX)], capture_output=True, text=True)
    lines = result.stdout.strip().splitlines()
    if result.returncode != 0 or not lines:
        raise ToolError(f"no nginx binary: tools/get_nginx.sh failed: {result.stderr.strip() or result.stdout.strip()}")
    return Path(lines[-1])


def nginx_test(binary: Path, conf: Path, prefix: Path) -> subprocess.CompletedProcess[str]:
    """`nginx -t` on conf; -e keeps the startup error log off the system path."""
    return subprocess.run(
        [str(binary), "-t", "-p", str(prefix), "-c", str(conf), "-e", str(prefix / "startup-error.log")],
        capture_output=True,
        text=True,
    )
