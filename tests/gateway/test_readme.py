"""The README's serving examples work as printed (against the test server)."""
from __future__ import annotations

import json
import pathlib
import re
import shutil
import subprocess

import pytest

README = pathlib.Path(__file__).resolve().parents[2] / "README.md"
README_ADDRESS = "127.0.0.1:8080"


def _blocks(language: str) -> list[str]:
    return re.findall(rf"```{language}\n(.*?)```", README.read_text(), flags=re.S)


def _pointed_at(code: str, server) -> str:
    assert README_ADDRESS in code
    return code.replace(README_ADDRESS, server.base_url.removeprefix("http://"))


def test_readme_python_examples_run_against_the_server(server, capsys):
    examples = [b for b in _blocks("python") if README_ADDRESS in b]
    assert len(examples) == 2  # the OpenAI SDK and the InferenceClient
    for code in examples:
        exec(compile(_pointed_at(code, server), "README.md", "exec"), {})
    printed = capsys.readouterr().out
    assert "Paris" in printed


@pytest.mark.skipif(shutil.which("curl") is None, reason="curl is not installed")
def test_readme_curl_example(server):
    command = next(b for b in _blocks("bash") if "curl" in b and README_ADDRESS in b).strip()
    out = subprocess.run(_pointed_at(command, server), shell=True, capture_output=True, text=True, timeout=120)
    body = json.loads(out.stdout)
    assert "Paris" in body["choices"][0]["message"]["content"]
    assert body["id"].startswith("chatcmpl-") and body["usage"]["completion_tokens"] > 0
