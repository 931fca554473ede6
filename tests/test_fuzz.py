"""Fuzzing the gateway's OpenAPI with schemathesis (a bounded number of cases): whatever
a client sends, the answer is never a 5xx and never hangs."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

from gateway.server.tenants.cli import ensure_local_key


def test_no_generated_request_gets_a_5xx_or_hangs(stack, tmp_path: Path) -> None:
    # Its own Redis db and MongoDB database, with an admin key of its own: the fuzzer calls
    # the admin routes too (tenant limits, keys), which must not change the shared stack.
    database = "fuzz"
    key, _ = ensure_local_key(tmp_path / "api_key", stack.launcher.mongo_url, database, tenant="fuzz")
    # Long-polls are capped at 5 s here, so any answer slower than the request timeout is a hang.
    gateway, url = stack.start_gateway(
        "gateway-fuzz", REDIS_URL=stack.redis_db_url(50), MONGO_DB=database, MAX_WAIT_S="5"
    )
    try:
        command = [
            str(Path(sys.executable).parent / "schemathesis"),
            "run",
            f"{url}/openapi.json",
            "--checks",
            "not_a_server_error",
            # (schemathesis' "coverage" phase trips over an internal hypothesis error here.)
            "--phases",
            "examples,fuzzing",
            "--max-examples",
            "40",
            "--request-timeout",
            "20",
            "--workers",
            "2",
            "--seed",
            "20261122",
            "--no-shrink",
            "--warnings",
            "off",
            "--exclude-path",
            "/metrics",
            "--header",
            f"Authorization: Bearer {key}",
        ]
        run = subprocess.run(command, capture_output=True, text=True, timeout=300, cwd=tmp_path)
        report = run.stdout[-6000:] + run.stderr[-2000:]
        assert run.returncode == 0, report
    finally:
        stack.stop(gateway)
