"""The architecture as a test: commlib's layers only point down (import-linter's contracts in
pyproject.toml, run by ``lint-imports``), no module of commlib imports another that imports it
back, and imports inside functions only defer optional dependencies."""

import ast
import pathlib
import shutil
import subprocess
import sys
import tomllib

import pytest
from conftest import ROOT

grimp = pytest.importorskip("grimp", reason="import-linter is not installed (the 'test' extra)")

PACKAGE = ROOT / "commlib"
# What an import inside a function may load, and why: optional dependencies (CuPy, NVML,
# matplotlib: the 'cuda' and 'plot' extras), and mpi4py in the NCCL engine, where importing it
# initializes MPI (a process that only imports the module must not).
DEFERRED = {"cupy", "cupy.cuda", "pynvml", "matplotlib", "matplotlib.pyplot", "mpi4py"}


def test_lint_imports_keeps_every_contract():
    # the console script installed beside this interpreter (the 'test' extra)
    exe = shutil.which("lint-imports", path=str(pathlib.Path(sys.executable).parent))
    assert exe is not None, "lint-imports is missing: pip install -e '.[test]'"
    proc = subprocess.run([exe, "--config", str(ROOT / "pyproject.toml")], cwd=ROOT,
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "0 broken" in proc.stdout and "KEPT" in proc.stdout, proc.stdout


def test_contracts_cover_every_subpackage():
    """Every subpackage and top-level module of commlib sits in a layer of the contract."""
    layers = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["importlinter"]["contracts"][0]["layers"]
    named = {m.strip().removeprefix("commlib.") for line in layers for m in line.split("|")}
    present = {p.stem if p.is_file() else p.name for p in PACKAGE.iterdir()
               if (p.is_dir() and (p / "__init__.py").exists()) or (p.suffix == ".py" and p.stem != "__init__")}
    assert present <= named, f"not in any layer: {sorted(present - named)}"


def test_no_import_circles():
    """No two modules of commlib import each other, directly or through others (a package
    importing its own submodules, which they may not import back, is not a circle)."""
    graph = grimp.build_graph("commlib")
    modules = sorted(m for m in graph.modules if m.startswith("commlib"))
    circles = []
    for a in modules:
        for b in graph.find_modules_directly_imported_by(a):
            if b.startswith(a + ".") or a.startswith(b + "."):
                continue  # a package and its own submodules
            if graph.chain_exists(importer=b, imported=a):
                chain = graph.find_shortest_chain(importer=b, imported=a)
                circles.append(f"{a} -> {' -> '.join(chain)}")
    assert not circles, "\n".join(circles)


def test_imports_inside_functions_only_defer_optional_dependencies():
    found = []
    for path in sorted(PACKAGE.rglob("*.py")):
        tree = ast.parse(path.read_text())
        for fn in ast.walk(tree):
            if not isinstance(fn, (ast.FunctionDef, ast.AsyncFunctionDef)):
                continue
            for node in ast.walk(fn):
                if isinstance(node, ast.Import):
                    names = [a.name for a in node.names]
                elif isinstance(node, ast.ImportFrom):
                    names = ["." * node.level + (node.module or "")]
                else:
                    continue
                found += [f"{path.relative_to(ROOT)}:{node.lineno}: {n}" for n in names
                          if n not in DEFERRED]
    assert not found, "imports inside functions that are not optional dependencies:\n" + "\n".join(found)
