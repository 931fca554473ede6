"""The agent CLIs people run, unmodified, against the real stack: Claude Code (its print mode)
and the Codex CLI (`codex exec`, a custom provider with wire_api "responses"), the pinned
versions the Makefile's test install puts in .venv/agent-clis from npm.

- On llm_agent (a stand-in engine whose context holds their prompts: model_repo/local/llm_agent)
  each answers a question and exits 0, and each completes a turn in which the stand-in calls
  the first tool the client offers and the client sends the tool's result back (what is
  tested is the door, not the model: the stand-in answers "The tool answered." only once a
  tool's result is in its prompt).
- On llm (the test stack's tiny model, a few hundred tokens of context) each shows the
  gateway's reason: the prompt does not fit.

Telemetry, update checks and other traffic are off by the CLIs' documented variables (Claude
Code's environment; Codex's config: analytics off, no update check); HOME
and CODEX_HOME are throwaway folders. Without npm these tests skip, saying so; with npm and
no CLIs installed they fail (run `make install`)."""

from __future__ import annotations

import json
import re
import shutil
import subprocess
from pathlib import Path

import httpx
import pytest

from tests.conftest import AUTH

ROOT = Path(__file__).resolve().parents[1]
CLIS = ROOT / ".venv" / "agent-clis" / "node_modules"
CLAUDE = CLIS / "@anthropic-ai" / "claude-code-linux-x64" / "claude"
CODEX = CLIS / "@openai" / "codex-linux-x64" / "vendor" / "x86_64-unknown-linux-musl" / "bin" / "codex"
# The stand-in (model_repo/local/llm_engine/1/model.py's agent_reply) calls the first tool
# offered when the prompt asks for this, and says AFTER_TOOL once the result is back.
TRIGGER = "[call the first tool]"
ANSWER = "Hello from the stand-in."
AFTER_TOOL = "The tool answered."
STAND_IN = "llm_agent"
# A CLI run: its own start, the gateway's calls on a loaded 2-core machine (a generous bound,
# not a measurement).
RUN_TIMEOUT_S = 300

pytestmark = pytest.mark.skipif(shutil.which("npm") is None, reason="npm is absent: the agent CLIs cannot be installed")


def _pin(name: str) -> str:
    found = re.search(rf"^{name} := (\S+)$", (ROOT / "Makefile").read_text(), re.MULTILINE)
    assert found is not None, f"the Makefile pins {name}"
    return found.group(1)


@pytest.fixture(scope="module")
def clis() -> None:
    missing = [str(path) for path in (CLAUDE, CODEX) if not path.exists()]
    assert not missing, f"the agent CLIs are not installed ({', '.join(missing)}): run `make install`"
    claude = subprocess.run([str(CLAUDE), "--version"], capture_output=True, text=True, timeout=120)
    assert _pin("CLAUDE_CODE_VERSION") in claude.stdout, claude.stdout + claude.stderr
    codex = subprocess.run([str(CODEX), "--version"], capture_output=True, text=True, timeout=120)
    assert _pin("CODEX_VERSION") in codex.stdout, codex.stdout + codex.stderr


def _claude(stack, tmp_path: Path, model: str, prompt: str, *flags: str) -> tuple[int, dict]:
    home = tmp_path / "home"
    home.mkdir()
    env = {
        "PATH": "/usr/bin:/bin",
        "HOME": str(home),
        "ANTHROPIC_BASE_URL": stack.gateway_url,
        "ANTHROPIC_API_KEY": stack.api_key,
        # Every model it asks for (side tasks ask for the small and fast one) is the one served.
        "ANTHROPIC_MODEL": model,
        "ANTHROPIC_SMALL_FAST_MODEL": model,
        "ANTHROPIC_DEFAULT_HAIKU_MODEL": model,
        "ANTHROPIC_DEFAULT_SONNET_MODEL": model,
        "ANTHROPIC_DEFAULT_OPUS_MODEL": model,
        "DISABLE_TELEMETRY": "1",
        "DISABLE_AUTOUPDATER": "1",
        "CLAUDE_CODE_DISABLE_NONESSENTIAL_TRAFFIC": "1",
    }
    argv = [str(CLAUDE), "-p", prompt, "--model", model, "--output-format", "json", "--max-turns", "3", *flags]
    done = subprocess.run(
        argv, env=env, cwd=home, capture_output=True, text=True, timeout=RUN_TIMEOUT_S, stdin=subprocess.DEVNULL
    )
    lines = [line for line in done.stdout.splitlines() if line.startswith("{")]
    assert lines, f"no JSON result (exit {done.returncode}): {done.stdout[-2000:]} {done.stderr[-2000:]}"
    return done.returncode, json.loads(lines[-1])


def _codex(stack, tmp_path: Path, model: str, prompt: str, setting: str = "") -> subprocess.CompletedProcess[str]:
    home, codex_home, work = tmp_path / "home", tmp_path / "codex", tmp_path / "work"
    for folder in (home, codex_home, work):
        folder.mkdir()
    (codex_home / "config.toml").write_text(
        f'model = "{model}"\n'
        'model_provider = "gateway"\n'
        f"{setting}\n"
        "check_for_update_on_startup = false\n"
        "[analytics]\nenabled = false\n"
        "[model_providers.gateway]\n"
        'name = "gateway"\n'
        f'base_url = "{stack.gateway_url}/v1"\n'
        'env_key = "GATEWAY_KEY"\n'
        'wire_api = "responses"\n'
    )
    env = {"PATH": "/usr/bin:/bin", "HOME": str(home), "CODEX_HOME": str(codex_home), "GATEWAY_KEY": stack.api_key}
    argv = [str(CODEX), "exec", "--skip-git-repo-check", "--sandbox", "read-only", prompt]
    return subprocess.run(
        argv, env=env, cwd=work, capture_output=True, text=True, timeout=RUN_TIMEOUT_S, stdin=subprocess.DEVNULL
    )


def _max_input_tokens(stack, model: str) -> int:
    found = httpx.get(f"{stack.gateway_url}/v1/models/{model}", headers=AUTH, timeout=30)
    assert found.status_code == 200, found.text
    return int(found.json()["max_input_tokens"])


# -- Claude Code ------------------------------------------------------------------------------


# Its defaults, and its most minimal mode (the two runs).
CLAUDE_MODES = {"defaults": (), "bare": ("--bare",)}
CODEX_MODES = {"defaults": "", "minimal": 'model_reasoning_effort = "minimal"'}


@pytest.mark.parametrize("mode", CLAUDE_MODES)
def test_claude_code_answers_a_question_through_the_gateway(clis, stack, tmp_path, mode: str) -> None:
    code, result = _claude(stack, tmp_path, STAND_IN, "hi", *CLAUDE_MODES[mode])
    assert code == 0 and result["is_error"] is False, result
    assert result["result"] == ANSWER


@pytest.mark.parametrize("mode", CLAUDE_MODES)
def test_claude_code_calls_a_tool_and_sends_its_result_back(clis, stack, tmp_path, mode: str) -> None:
    code, result = _claude(stack, tmp_path, STAND_IN, TRIGGER, *CLAUDE_MODES[mode])
    assert code == 0 and result["is_error"] is False, result
    assert result["result"] == AFTER_TOOL and result["num_turns"] == 2


def test_claude_code_shows_the_gateways_reason_when_the_prompt_does_not_fit(clis, stack, tmp_path) -> None:
    code, result = _claude(stack, tmp_path, "llm", "hi")
    assert code != 0 and result["is_error"] is True
    assert result["api_error_status"] == 400
    # Claude Code reads Anthropic's words ("prompt is too long: N tokens > M maximum").
    assert "Prompt is too long" in result["result"]
    assert f"limit {_max_input_tokens(stack, 'llm')}" in result["result"]


# -- the Codex CLI ----------------------------------------------------------------------------


@pytest.mark.parametrize("mode", CODEX_MODES)
def test_codex_answers_a_question_through_the_gateway(clis, stack, tmp_path, mode: str) -> None:
    done = _codex(stack, tmp_path, STAND_IN, "hi", CODEX_MODES[mode])
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stdout.strip().splitlines()[-1] == ANSWER


@pytest.mark.parametrize("mode", CODEX_MODES)
def test_codex_calls_a_tool_and_sends_its_result_back(clis, stack, tmp_path, mode: str) -> None:
    done = _codex(stack, tmp_path, STAND_IN, TRIGGER, CODEX_MODES[mode])
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stdout.strip().splitlines()[-1] == AFTER_TOOL


def test_codex_shows_the_gateways_reason_when_the_prompt_does_not_fit(clis, stack, tmp_path) -> None:
    done = _codex(stack, tmp_path, "llm", "hi")
    assert done.returncode != 0
    assert "prompt_too_long" in done.stderr
    assert f"this model takes at most {_max_input_tokens(stack, 'llm')}" in done.stderr
