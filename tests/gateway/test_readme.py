"""The README's serving examples work as printed (against the test server): one per client
family, each answering the README's question."""
from __future__ import annotations

import json
import pathlib
import re
import shutil
import subprocess

import pytest

README = pathlib.Path(__file__).resolve().parents[2] / "README.md"
README_ADDRESS = "127.0.0.1:8080"
# the client each Python example imports, in the README's order
CLIENTS = ("openai", "langchain_openai", "llama_index.llms.openai_like", "huggingface_hub")


def _blocks(language: str) -> list[str]:
    return re.findall(rf"```{language}\n(.*?)```", README.read_text(), flags=re.S)


def _pointed_at(code: str, server) -> str:
    assert README_ADDRESS in code
    return code.replace(README_ADDRESS, server.base_url.removeprefix("http://"))


def _examples() -> list[str]:
    return [b for b in _blocks("python") if README_ADDRESS in b]


def test_the_readme_has_one_python_example_per_client_family():
    imported = [re.search(r"^from (\S+) import", code, flags=re.M).group(1) for code in _examples()]
    assert tuple(imported) == CLIENTS


@pytest.mark.parametrize("client", CLIENTS)
def test_readme_python_example_runs_against_the_server(client, server, capsys):
    code = next(b for b in _examples() if re.search(rf"^from {re.escape(client)} import", b, flags=re.M))
    exec(compile(_pointed_at(code, server), "README.md", "exec"), {})
    assert "Paris" in capsys.readouterr().out


@pytest.mark.skipif(shutil.which("curl") is None, reason="curl is not installed")
def test_readme_curl_example(server):
    command = next(b for b in _blocks("bash") if "curl" in b and README_ADDRESS in b).strip()
    out = subprocess.run(_pointed_at(command, server), shell=True, capture_output=True, text=True, timeout=120)
    body = json.loads(out.stdout)
    assert "Paris" in body["choices"][0]["message"]["content"]
    assert body["id"].startswith("chatcmpl-") and body["usage"]["completion_tokens"] > 0
