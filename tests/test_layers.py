"""The layering of kernels, references and formats, read from the sources (no import, no Triton needed).

* ``vc_compile/formats.py`` (tile and numeric constants, quantised-tensor records, layouts) and
  ``vc_compile/torch_ops.py`` (plain-torch steps run on every device) import neither layer below.
* Kernels (``kernels/``) never import ``reference/`` and references never import ``kernels/``: the oracle
  does not share code with what it checks, only the formats both implement.
* No production module imports ``reference/`` except ``kernels/dispatch.py``, whose REFERENCE branches are
  the CPU path.
* Every name of formats.py is defined there and nowhere else in the package (one BLOCK_V).
"""
import ast
from pathlib import Path

import pytest

PKG = Path(__file__).resolve().parents[1] / "vc_compile"
SHARED = ("formats.py", "torch_ops.py")
# chooses the implementation per call: its REFERENCE branches are the CPU path and run the oracle
DISPATCH = PKG / "kernels" / "dispatch.py"


def module_name(path: Path) -> str:
    parts = path.relative_to(PKG.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def imported_modules(path: Path, module: str = ""):
    """(line, absolute module) of every import in ``path`` (module ``module``, by default its name in the
    package; module level or inside functions); a ``from X import y`` counts as X and as X.y (y may be a
    submodule)."""
    tree = ast.parse(path.read_text(), filename=str(path))
    pkg = (module or module_name(path)).split(".")
    if path.name != "__init__.py":
        pkg = pkg[:-1]
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for a in node.names:
                yield node.lineno, a.name
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                up = pkg[:len(pkg) - node.level + 1]
                base = ".".join(up + ([base] if base else []))
            yield node.lineno, base
            for a in node.names:
                yield node.lineno, f"{base}.{a.name}"


def offenders(paths, prefix: str):
    return [f"{p.relative_to(PKG.parent)}:{line}: {mod}" for p in paths for line, mod in imported_modules(p)
            if mod == prefix or mod.startswith(prefix + ".")]


def package_files():
    return sorted(PKG.rglob("*.py"))


def test_the_scanner_sees_relative_and_lazy_imports(tmp_path):
    f = tmp_path / "probe.py"
    f.write_text("from . import configs\n"
                 "def f():\n    from ..reference import quant\n    import vc_compile.reference.select as s\n")
    mods = [m for _, m in imported_modules(f, "vc_compile.kernels.probe")]
    assert {"vc_compile.kernels.configs", "vc_compile.reference.quant", "vc_compile.reference.select"} <= set(mods)


def test_kernels_do_not_import_references():
    kernels = [p for p in sorted((PKG / "kernels").glob("*.py")) if p != DISPATCH]
    assert len(kernels) > 10
    assert offenders(kernels, "vc_compile.reference") == []


def test_references_do_not_import_kernels():
    refs = sorted((PKG / "reference").glob("*.py"))
    assert len(refs) > 10
    assert offenders(refs, "vc_compile.kernels") == []


@pytest.mark.parametrize("name", SHARED)
def test_shared_formats_import_no_layer(name):
    path = PKG / name
    bad = offenders([path], "vc_compile.reference") + offenders([path], "vc_compile.kernels")
    bad += offenders([path], "triton")  # importable without Triton: the references run on any machine
    if name == "formats.py":
        bad += offenders([path], "vc_compile.torch_ops")
    assert bad == []


def test_no_production_module_imports_references():
    """methods/, ops.py, runtime/, passes/, the kernels, the tuner, the CLI, the demo: only dispatch may choose
    the reference (the CPU path); everything else runs on the GPU path too."""
    prod = [p for p in package_files() if "reference" not in p.relative_to(PKG).parts and p != DISPATCH]
    assert PKG / "ops.py" in prod and PKG / "methods" / "mcsparse.py" in prod
    assert offenders(prod, "vc_compile.reference") == []


def defined_names(path: Path):
    """Module-level names bound by ``path``: assignments, functions, classes (not imports)."""
    tree = ast.parse(path.read_text(), filename=str(path))
    for node in tree.body:
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            yield node.name
        elif isinstance(node, ast.Assign):
            for t in node.targets:
                for n in ast.walk(t):
                    if isinstance(n, ast.Name):
                        yield n.id
        elif isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name):
            yield node.target.id


def test_format_names_are_defined_once():
    """A tile constant, numeric constant, record or layout helper of formats.py is bound nowhere else in the
    package (imported, never redefined). torch_ops.py's functions are exempt: kernels and references share
    names by design (``select_topk`` is the radix kernel, its oracle and the torch top-K)."""
    owned = set(defined_names(PKG / "formats.py"))
    for must in ("BLOCK_Q", "BLOCK_K", "BLOCK_V", "K_MEAN_TOKENS", "KV_TILE", "LOG2E", "FP8_MAX", "FP8_DTYPE",
                 "EXPCAST_OFFSET", "SHIFT_BETA", "QKQuant", "VQuant", "KMeansResult", "RopeArgs", "RopeSpec",
                 "sm90_key_order", "to_sm90_layout", "natural_layout", "n_keep"):
        assert must in owned, must
    dup = [f"{p.relative_to(PKG.parent)}: {n}" for p in package_files() if p != PKG / "formats.py"
           for n in sorted(set(defined_names(p)) & owned) if not n.startswith("_")]
    assert dup == []


def import_graph():
    """{module: modules of the package it imports}, at module level or inside functions. ``from X import y`` is an
    edge to X.y where that is a module, else to X (a name X defines); importing X.y is not counted as importing
    X's ``__init__`` (Python runs it, but a package's ``__init__`` here imports nothing of its own parents)."""
    names = {module_name(p): p for p in package_files()}

    def resolve(mod):
        while mod and mod not in names:
            mod = mod.rpartition(".")[0]
        return mod or None

    graph = {}
    for mod, path in names.items():
        tree = ast.parse(path.read_text(), filename=str(path))
        pkg = mod.split(".") if path.name == "__init__.py" else mod.split(".")[:-1]
        out = set()
        for node in ast.walk(tree):
            if isinstance(node, ast.Import):
                targets = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:
                    base = ".".join(pkg[:len(pkg) - node.level + 1] + ([base] if base else []))
                targets = [f"{base}.{a.name}" if f"{base}.{a.name}" in names else base for a in node.names]
            else:
                continue
            out |= {r for r in map(resolve, targets) if r and r != mod}
        graph[mod] = out
    return graph


def find_cycle(graph):
    """One cycle of ``graph`` as a list of nodes (first == last), or None."""
    state, stack = {}, []

    def visit(v):
        state[v] = 1
        stack.append(v)
        for w in sorted(graph.get(v, ())):
            if state.get(w) == 1:
                return stack[stack.index(w):] + [w]
            if w not in state:
                found = visit(w)
                if found:
                    return found
        stack.pop()
        state[v] = 2
        return None

    for v in sorted(graph):
        if v not in state:
            found = visit(v)
            if found:
                return found
    return None


def room(mod: str) -> str:
    """The folder (``vc_compile.runtime``) or top-level module (``vc_compile.ops``) a module lives in."""
    return ".".join(mod.split(".")[:2])


def test_the_cycle_finder_finds_a_cycle_and_accepts_a_dag():
    assert find_cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]
    assert find_cycle({"a": {"b", "c"}, "b": {"c"}, "c": set()}) is None


def test_the_package_imports_form_no_cycle():
    """No module reaches itself through imports (lazy ones included): every layer can be read, tested and
    replaced from the bottom up. The run-time state sits at the bottom (``runtime/runtime.py`` imports nothing of
    the package but the step tracker); the parts built elsewhere register their factories with it."""
    graph = import_graph()
    assert len(graph) > 80 and "vc_compile.runtime.report" in graph["vc_compile.ops"]
    assert find_cycle(graph) is None


def test_the_folders_import_each_other_one_way():
    """Between folders (and top-level modules) imports go one way only: no arrow back up."""
    rooms = {}
    for mod, deps in import_graph().items():
        rooms.setdefault(room(mod), set()).update(room(d) for d in deps if room(d) != room(mod))
    assert "vc_compile.runtime" in rooms["vc_compile.kernels"]
    assert find_cycle(rooms) is None


def _py_lines(folder: Path) -> int:
    return sum(len(p.read_text().splitlines()) for p in folder.rglob("*.py"))


def test_the_product_apart_from_its_workshop():
    """The repository is the package, its tests, the benchmarks behind published tables, the docs and the tools
    people run; finished experiments leave a design record, not a script. The benchmarks and tools together stay
    within 30% of the package's lines, and the README is a front door (<= 200 lines)."""
    import subprocess

    root = PKG.parent
    r = subprocess.run(["git", "ls-files"], cwd=root, capture_output=True, text=True)
    if r.returncode != 0:
        pytest.skip("not a git checkout: the tracked files cannot be listed")
    top = {f.split("/")[0] for f in r.stdout.split()}
    assert top <= {"vc_compile", "tests", "benchmarks", "docs", "tools", ".ci", "README.md", "LICENSE",
                   "pyproject.toml", ".gitignore"}, sorted(top)
    assert len((root / "README.md").read_text().splitlines()) <= 200
    workshop, package = _py_lines(root / "benchmarks") + _py_lines(root / "tools"), _py_lines(PKG)
    assert workshop <= 0.30 * package, (workshop, package)
