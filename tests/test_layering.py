"""docs/design.md's import rules, read from the source, and the `kernels` / `proto` name clashes."""

from __future__ import annotations

import ast
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
PACKAGES = ["proto", "configs", "kernels", "engine", "prefill_worker", "decode_worker", "router", "cluster", "loadgen"]
ALLOWED = {
    "proto": set(),
    "configs": set(),
    "kernels": set(),
    "engine": {"kernels", "configs", "proto"},
    "prefill_worker": {"engine", "configs", "proto"},
    "decode_worker": {"engine", "configs", "proto"},
    "router": {"configs", "proto"},
    # The load generator talks to a cluster over the wire only.
    "loadgen": {"proto"},
    "cluster": set(PACKAGES) - {"cluster"},
}
# The router process must stay light: no torch (nor anything that imports it).
FORBIDDEN_THIRD_PARTY = {"router": {"torch", "transformers", "triton"}, "loadgen": {"torch", "transformers", "ray"}}
# Test fixtures (tests/local_cluster.py, fault-injection hooks) are never shipped nor imported by what is.
FORBIDDEN_EVERYWHERE = {"tests"}


def imported_modules(path: Path) -> set[str]:
    tree = ast.parse(path.read_text(), filename=str(path))
    names = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names.update(alias.name.split(".")[0] for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            names.add(node.module.split(".")[0])
    return names


def test_every_package_exists_with_a_docstring():
    for pkg in PACKAGES:
        init = REPO / pkg / "__init__.py"
        assert init.is_file(), f"{pkg}/__init__.py missing"
        assert ast.get_docstring(ast.parse(init.read_text())), f"{pkg}/__init__.py has no docstring"


def test_imports_follow_the_dag():
    violations = []
    for pkg in PACKAGES:
        for path in (REPO / pkg).rglob("*.py"):
            for name in imported_modules(path):
                if name in PACKAGES and name != pkg and name not in ALLOWED[pkg]:
                    violations.append(f"{path.relative_to(REPO)} imports {name}")
                if name in FORBIDDEN_EVERYWHERE:
                    violations.append(f"{path.relative_to(REPO)} imports {name} (a test fixture)")
                if name in FORBIDDEN_THIRD_PARTY.get(pkg, ()):
                    violations.append(f"{path.relative_to(REPO)} imports {name} (not allowed in {pkg})")
    assert not violations, "\n".join(violations)


def test_the_checker_sees_a_violation(tmp_path):
    bad = tmp_path / "bad.py"
    bad.write_text("import decode_worker.x\nfrom engine import LLM\n")
    assert imported_modules(bad) == {"decode_worker", "engine"}


def test_kernels_and_proto_resolve_to_this_repo():
    from transformers.utils import is_kernels_available

    import kernels
    import proto

    assert Path(kernels.__file__).resolve().parent == REPO / "kernels"
    assert Path(proto.__file__).resolve().parent == REPO / "proto"
    # Our distribution provides the `kernels` import name; transformers must not take it for
    # Hugging Face's kernel hub (it checks the version range).
    assert is_kernels_available() is False


def test_the_router_process_loads_no_torch():
    """The static rule above misses imports of imports: load the router and the load generator
    for real and look at what came in."""
    import subprocess
    import sys

    code = ("import sys, router.server, router.openai_http, loadgen.runner, loadgen.compare; "
            "print(sorted(m for m in ('torch', 'transformers', 'ray', 'engine', 'tests') if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]", out.stdout + out.stderr


def test_every_subpackage_is_packaged():
    """pyproject.toml lists packages one by one: a new subpackage missing there would be absent
    from a wheel (an editable install hides it)."""
    import tomllib

    listed = set(tomllib.loads((REPO / "pyproject.toml").read_text())["tool"]["setuptools"]["packages"])
    found = {".".join(init.parent.relative_to(REPO).parts) for pkg in PACKAGES for init in (REPO / pkg).rglob("__init__.py")}
    assert found <= listed, f"not in pyproject.toml [tool.setuptools] packages: {sorted(found - listed)}"
