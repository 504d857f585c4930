"""The README and the documentation site stay true to what they describe: the README's test
command is what CI runs, its links resolve, every page is in the site's navigation, and the
serving page names every flag of `switchyard serve`. (CI also builds the site with
`mkdocs build --strict`, which checks every link and anchor between pages.)"""
from __future__ import annotations

import pathlib
import re

import yaml

from switchyard.gateway.cli import build_parser

ROOT = pathlib.Path(__file__).resolve().parents[1]
README = (ROOT / "README.md").read_text()
DOCS = ROOT / "docs"


def _bash_blocks(text: str) -> list[str]:
    return [b.strip() for b in re.findall(r"```bash\n(.*?)```", text, flags=re.S)]


def _ci_commands() -> list[str]:
    """.ci/run's command lines, without comments and its own set-up (set -e, cd)."""
    lines = [line.strip() for line in (ROOT / ".ci" / "run").read_text().splitlines()]
    return [line for line in lines if line and not line.startswith(("#", "set ", "cd "))]


def test_the_readme_test_command_is_what_ci_runs_first():
    (test_command,) = [b for b in _bash_blocks(README) if "pytest" in b]
    assert _ci_commands()[0] == test_command


def test_ci_builds_the_docs_strictly_after_the_tests():
    commands = _ci_commands()
    docs = next(i for i, c in enumerate(commands) if "mkdocs build" in c)
    assert docs > 0 and "--strict" in commands[docs] and "'.[docs]'" in commands[docs]


def test_the_readme_is_a_guide_not_a_notebook():
    assert len(README.splitlines()) <= 250


def test_the_readme_links_resolve():
    targets = re.findall(r"\]\(([^)#\s]+)(?:#[^)]*)?\)", README)
    local = [t for t in targets if not re.match(r"[a-z]+://", t)]
    assert any(t.startswith("docs/") for t in local)
    missing = [t for t in local if not (ROOT / t).exists()]
    assert not missing


def _nav_pages(entries) -> list[str]:
    pages = []
    for entry in entries:
        value = next(iter(entry.values())) if isinstance(entry, dict) else entry
        pages += _nav_pages(value) if isinstance(value, list) else [value]
    return pages


def test_every_docs_page_is_in_the_nav():
    config = yaml.safe_load((ROOT / "mkdocs.yml").read_text())
    pages = set(_nav_pages(config["nav"]))
    written = {str(p.relative_to(DOCS)) for p in DOCS.rglob("*.md") if "results" not in p.relative_to(DOCS).parts}
    assert pages == written


def test_the_serving_page_names_every_serve_flag():
    serve = build_parser({})._subparsers._group_actions[0].choices["serve"]
    flags = [max(a.option_strings, key=len) for a in serve._actions if a.option_strings and a.dest != "help"]
    page = (DOCS / "serving.md").read_text()
    assert [f for f in flags if f"`{f}`" not in page] == []


def test_the_models_page_lists_every_quantization_method_with_its_backends():
    from switchyard.core.quant.methods import METHODS

    page = (DOCS / "models.md").read_text()
    rows = dict(re.findall(r"^\| `([a-z0-9-]+)` \| [^|]* \| ([a-z, ]+) \|", page, flags=re.M))
    assert {name: tuple(rows.get(name, "").split(", ")) for name in METHODS} == \
        {name: method.backends for name, method in METHODS.items()}
