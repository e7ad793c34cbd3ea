"""How the package is laid out and imported: ``passes/`` (a top-level folder of the source tree)
is the package ``fx_fastprefill.passes`` from a wheel, from an editable install and from a bare
checkout, bound on its parent, and never a second copy under another name."""

from __future__ import annotations

import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def _python(code: str, cwd: Path, env_path: str | None = None) -> subprocess.CompletedProcess:
    env = {"PATH": "/usr/bin:/bin", **({"PYTHONPATH": env_path} if env_path else {})}
    return subprocess.run([sys.executable, "-c", code], cwd=cwd, env=env, capture_output=True, text=True,
                          timeout=300)


BOUND = ("import sys, fx_fastprefill.passes.fx_utils as u, fx_fastprefill; "
         "p = fx_fastprefill.passes; assert p is sys.modules['fx_fastprefill.passes'] and u is p.fx_utils; "
         "print(p.__file__)")


def test_installed_passes_are_bound_on_their_parent(tmp_path):
    """This environment's install (editable in CI): setuptools' mapping, the standard machinery."""
    done = _python(BOUND, cwd=tmp_path)
    assert done.returncode == 0, done.stderr[-2000:]
    assert Path(done.stdout.split()[-1]) == ROOT / "passes" / "__init__.py"


def test_a_bare_checkout_loads_and_binds_the_passes(tmp_path):
    """Nothing installed (the install's finder taken off the meta path), the checkout on the path."""
    code = ("import sys; sys.meta_path[:] = [f for f in sys.meta_path if 'editable' not in type(f).__module__]; "
            f"sys.path.insert(0, {str(ROOT)!r}); " + BOUND)
    done = _python(code, cwd=tmp_path)
    assert done.returncode == 0, done.stderr[-2000:]
    assert Path(done.stdout.split()[-1]) == ROOT / "passes" / "__init__.py"


def test_importing_passes_by_its_folder_name_is_refused():
    done = _python("import passes.hoist_rules", cwd=ROOT, env_path=str(ROOT))
    assert done.returncode != 0
    assert "import that (or `import fx_fastprefill`), not 'passes'" in done.stderr


def test_a_built_wheel_installs_the_passes_as_fx_fastprefill_passes(tmp_path):
    """Build a wheel of the checkout, install it into a folder of its own and import from there
    (no checkout on the path): the install mapping itself, which an editable install never uses."""
    source = tmp_path / "source"  # a copy: setuptools builds in the tree and leaves build/ there
    source.mkdir()
    for name in ("pyproject.toml", "README.md"):
        shutil.copy(ROOT / name, source / name)
    for name in ("fx_fastprefill", "passes"):
        shutil.copytree(ROOT / name, source / name, ignore=shutil.ignore_patterns("__pycache__"))
    built = subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q",
                            "-w", str(tmp_path / "dist"), str(source)], capture_output=True, text=True, timeout=600)
    if built.returncode != 0 and "No module named" in built.stderr:
        pytest.skip(f"cannot build a wheel here: {built.stderr.strip()[-300:]}")
    assert built.returncode == 0, built.stderr[-2000:]
    [wheel] = (tmp_path / "dist").glob("fx_fastprefill-*.whl")
    names = zipfile.ZipFile(wheel).namelist()
    assert "fx_fastprefill/passes/hoist_rules.py" in names and not any(n.startswith("passes/") for n in names)
    site = tmp_path / "site"
    with zipfile.ZipFile(wheel) as archive:  # what pip install --target does, minus the metadata
        archive.extractall(site)
    code = ("import sys; sys.meta_path[:] = [f for f in sys.meta_path if 'editable' not in type(f).__module__]; "
            f"sys.path.insert(0, {str(site)!r}); " + BOUND)
    done = _python(code, cwd=tmp_path)
    assert done.returncode == 0, done.stderr[-2000:]
    assert Path(done.stdout.split()[-1]) == site / "fx_fastprefill" / "passes" / "__init__.py"


# The layers, bottom up: a module imports only modules of its own layer or below (docs/design.md,
# "Layout"). Keys are package-relative module paths; the longest matching prefix decides.
LAYERS = {
    "fallbacks": 0, "logs": 0, "torch_seams": 0, "vocabulary": 0,
    "ops": 1,
    "passes": 2,
    "report": 3,
    "compilation": 4,
    "runtime": 5,
    "integrations": 6, "explain": 6, "__main__": 6,
}


def _modules() -> dict[str, Path]:
    found = {}
    for folder, package in ((ROOT / "fx_fastprefill", "fx_fastprefill"), (ROOT / "passes", "fx_fastprefill.passes")):
        for path in folder.rglob("*.py"):
            parts = list(path.relative_to(folder).with_suffix("").parts)
            if parts[-1] == "__init__":
                parts = parts[:-1]
            found[".".join([package, *parts])] = path
    return found


def _imports(name: str, path: Path, modules: dict[str, Path]) -> set[str]:
    """Every package module ``name`` imports, at the top or inside a function."""
    import ast
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                parts = package.split(".")
                base = ".".join(parts[:len(parts) - node.level + 1] + ([node.module] if node.module else []))
            targets = [base] + [f"{base}.{alias.name}" for alias in node.names]
        elif isinstance(node, ast.Import):
            targets = [alias.name for alias in node.names]
        else:
            continue
        found |= {t for t in targets if t in modules and t != name}
    return found


def _layer(name: str) -> int | None:
    rest = name.split(".")[1:]
    return LAYERS.get(rest[0]) if rest else None  # the package's __init__ stands outside the layers


def test_layers_import_only_downward_and_without_circles():
    modules = _modules()
    graph = {name: _imports(name, path, modules) for name, path in modules.items()}
    unplaced = [name for name in modules if name != "fx_fastprefill" and _layer(name) is None]
    assert not unplaced, f"modules in no layer: {unplaced}"
    upward = [f"{a} -> {b}" for a, targets in graph.items() for b in targets
              if _layer(a) is not None and _layer(b) is not None and _layer(b) > _layer(a)]
    assert not upward, "imports against the layers:\n" + "\n".join(sorted(upward))
    # No circle among the package's modules (the package's own __init__ aside: importing any
    # submodule runs it first, and it imports only the bottom layers eagerly).
    inner = {a: {b for b in targets if b != "fx_fastprefill"} for a, targets in graph.items() if a != "fx_fastprefill"}
    state: dict[str, int] = {}

    def visit(node: str, trail: list[str]) -> None:
        state[node] = 1
        for nxt in sorted(inner[node]):
            if state.get(nxt) == 1:
                raise AssertionError("import circle: " + " -> ".join(trail[trail.index(nxt):] + [node, nxt]))
            if nxt not in state:
                visit(nxt, trail + [node])
        state[node] = 2

    for name in sorted(inner):
        if name not in state:
            visit(name, [])
