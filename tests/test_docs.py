"""The docs stay true to the tree: every module is in the module map (docs/architecture.md),
every repository path cited in the docs or in a source file exists, and the README stays a
front page (the manual lives in docs/)."""

from __future__ import annotations

import re
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
PACKAGES = ["proto", "configs", "kernels", "engine", "prefill_worker", "decode_worker", "router", "cluster", "loadgen"]
TOP = "proto|configs|kernels|engine|prefill_worker|decode_worker|router|cluster|loadgen|tests|benchmarks|docs|scripts"
# A repository path: a top-level folder, then path segments, then a file extension.
CITED = re.compile(rf"(?<![\w/.~-])(?:{TOP})/[\w/.-]*\w\.(?:py|md|yaml|cpp|h|proto|sh|json|csv|png)\b")


def modules() -> list[str]:
    found = []
    for pkg in PACKAGES:
        for path in sorted((REPO / pkg).rglob("*")):
            if path.suffix in {".py", ".cpp", ".h", ".proto"} and path.name != "__init__.py" \
                    and "_pb2" not in path.name and "__pycache__" not in path.parts:
                found.append(str(path.relative_to(REPO)))
    return found


def test_every_module_is_in_the_module_map():
    text = (REPO / "docs/architecture.md").read_text()
    missing = [m for m in modules() if f"`{m}`" not in text]
    assert not missing, f"not in docs/architecture.md: {missing}"


def cited_paths(text: str) -> set[str]:
    return set(CITED.findall(text))


def test_the_citation_pattern_sees_paths():
    assert cited_paths("see engine/model/llama.py and `docs/design.md`, not ~/x/engine/a.py") == {
        "engine/model/llama.py", "docs/design.md"}


def test_every_cited_path_exists():
    sources = [REPO / "README.md", *sorted((REPO / "docs").glob("*.md"))]
    for pkg in [*PACKAGES, "tests", "benchmarks"]:
        sources += sorted(p for p in (REPO / pkg).rglob("*") if p.suffix in {".py", ".cpp", ".h", ".proto"})
    sources += sorted((REPO / "configs").rglob("*.yaml"))
    broken = []
    for source in sources:
        for cited in cited_paths(source.read_text()):
            if not (REPO / cited).exists() and not any(ch in cited for ch in "*{"):
                broken.append(f"{source.relative_to(REPO)} cites {cited}")
    assert not broken, "\n".join(broken)


def test_readme_is_a_front_page():
    lines = (REPO / "README.md").read_text().splitlines()
    assert len(lines) <= 200, f"README.md has {len(lines)} lines; move the manual into docs/"
