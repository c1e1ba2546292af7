"""The package's layering, checked on its source: which modules may import which.

- No module outside ``cli/`` imports ``argparse``: the library takes option objects, never argparse namespaces.
- Model, objective and diffusion code never imports network code (serve, coordinator, worker, protocol, p2p, and
  the network libraries).
- ``model/`` imports nothing from ``diffusion/`` (the layer above it).
- No import circle anywhere in the package, imports under ``if TYPE_CHECKING:`` counted: a module that names
  another's types knows it.
- The coordinator's parts take no lock and write no other part's attributes: only its front (``service.py``) owns
  the lock; no ``sqlite3.Row`` leaves ``coordinator/tables.py`` and ``conduct_tables.py`` (and ``rows.py``, whose row
  types are built from one).
- ``serve/``'s subpackages import only downward: wire <- runtime <- stage, wire <- client <- gateway.
- Every module a docstring's ``:mod:`` names exists.
"""

from __future__ import annotations

import ast
import re
from pathlib import Path
from typing import cast

import pytest

SRC = Path(__file__).resolve().parents[1] / "src" / "blocktrain"
NETWORK = ("blocktrain.serve", "blocktrain.coordinator", "blocktrain.worker", "blocktrain.protocol", "blocktrain.p2p",
           "hivemind", "fastapi", "starlette", "uvicorn", "httpx", "socket", "asyncio", "http", "urllib")


def runtime_imports(path: Path) -> set[str]:
    """Modules ``path`` imports when it runs (anywhere in the file, functions included; not under TYPE_CHECKING)."""
    return imports(path, type_checking=False)


def imports(path: Path, *, type_checking: bool) -> set[str]:
    """Modules ``path`` imports (anywhere in the file, functions included), those under ``if TYPE_CHECKING:`` too
    where ``type_checking``: a module that names another's types knows it, whether or not the import runs."""
    tree = ast.parse(path.read_text())
    skip: set[int] = set()
    for node in ast.walk(tree):
        if not type_checking and isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test):
            skip.update(id(n) for child in node.body for n in ast.walk(child))
    out: set[str] = set()
    for node in ast.walk(tree):
        if id(node) in skip:
            continue
        if isinstance(node, ast.Import):
            out.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            out.add(node.module)
            out.update(f"{node.module}.{a.name}" for a in node.names)
    return out


def modules(sub: str = "") -> list[Path]:
    return sorted((SRC / sub).rglob("*.py"))


def name_of(path: Path) -> str:
    return "blocktrain." + ".".join(path.relative_to(SRC).with_suffix("").parts)


def test_only_the_cli_imports_argparse() -> None:
    offenders = [name_of(p) for p in modules() if "cli" not in p.relative_to(SRC).parts and "argparse" in runtime_imports(p)]
    assert offenders == []


@pytest.mark.parametrize("layer", ["model", "objectives", "diffusion"])
def test_math_layers_never_import_network_code(layer: str) -> None:
    offenders = {name_of(p): sorted(m for m in runtime_imports(p) if m.startswith(NETWORK)) for p in modules(layer)}
    assert {k: v for k, v in offenders.items() if v} == {}


def test_the_model_does_not_import_the_diffusion_layer() -> None:
    offenders = {name_of(p): sorted(m for m in runtime_imports(p) if m.startswith("blocktrain.diffusion"))
                 for p in modules("model")}
    assert {k: v for k, v in offenders.items() if v} == {}


@pytest.mark.parametrize(("a", "b"), [("data/dataset.py", "data/download.py"),
                                        ("serve/client/pipeline.py", "serve/client/decoding.py")])
def test_no_import_circle(a: str, b: str) -> None:
    ma, mb = name_of(SRC / a), name_of(SRC / b)
    assert not (mb in runtime_imports(SRC / a) and ma in runtime_imports(SRC / b)), f"{ma} and {mb} import each other"


# What each serving subpackage may import of serve/ (itself included).
SERVE_BELOW = {"wire": {"wire"}, "runtime": {"wire", "runtime"}, "stage": {"wire", "runtime", "stage"},
               "client": {"wire", "client"}, "gateway": {"wire", "client", "gateway"}}


def test_serve_imports_only_downward() -> None:
    """Every module of serve/ sits in one subpackage and imports serve/ only from those below it (or its own)."""
    offenders: dict[str, list[str]] = {}
    for path in modules("serve"):
        parts = path.relative_to(SRC / "serve").parts
        if len(parts) == 1:
            assert path.name == "__init__.py", f"{name_of(path)} belongs in one of {sorted(SERVE_BELOW)}"
            allowed: set[str] = set()
        else:
            assert parts[0] in SERVE_BELOW, f"{name_of(path)}: unknown serving subpackage {parts[0]!r}"
            allowed = SERVE_BELOW[parts[0]]
        used = {m.split(".")[2] for m in runtime_imports(path) if m.startswith("blocktrain.serve.")}
        if used - allowed:
            offenders[name_of(path)] = sorted(used - allowed)
    assert offenders == {}


# Places outside objectives/ that still name an objective's kind, each with why; the list may only shrink.
KIND_ALLOWED = {
    "blocktrain.config": "defines the choice",
    "blocktrain.presets": "chooses per preset",
    "blocktrain.serve.runtime.loading": "parse_shape's default for --random (the scale run's diffusion blocks), and "
                                        "a random denoiser's z_in initialised for scale runs",
    "blocktrain.bench.speed": "times block 0 of each built-in objective",
}
KIND = re.compile(
    r"\bObjective(?:Kind)?\.(?:STACK|DIFFUSION)\b"  # the enum
    r"|isinstance\([^)]*\b(?:BlockDenoiser|StackBlock|DiffusionObjective|StackObjective)\b"  # the classes
    r"|(?:==|!=|\bis|\bin)\s*[\"'](?:stack|diffusion)[\"']|[\"'](?:stack|diffusion)[\"']\s*(?:==|!=|\bin\b)"  # names
    r"|reference_name\s*[!=]=|getattr\([^)]*[\"']z_in[\"']"  # an objective's attributes, read as its kind
)


def test_objective_kinds_are_named_only_in_the_objective_seam() -> None:
    """Code outside ``objectives/`` asks the run's Objective (its methods and attributes), never which kind it is."""
    named = {name_of(p) for p in modules() if "objectives" not in p.relative_to(SRC).parts and KIND.search(p.read_text())}
    assert named - set(KIND_ALLOWED) == set(), "ask the Objective instead (objectives/base.py)"
    assert set(KIND_ALLOWED) - named == set(), "a place no longer names a kind: drop it from KIND_ALLOWED"


def test_no_import_circle_anywhere_in_the_package() -> None:
    """The whole graph of imports between blocktrain's modules, those under ``if TYPE_CHECKING:`` included, has no
    cycle (Tarjan's strongly connected components; a package's ``__init__`` counts as the package)."""
    files = {name_of(p).removesuffix(".__init__"): p for p in modules()}
    graph = {n: sorted(m for m in imports(p, type_checking=True) if m in files and m != n) for n, p in files.items()}
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    cycles: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        for w in graph[v]:
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = stack[stack.index(v):]
            del stack[stack.index(v):]
            if len(comp) > 1:
                cycles.append(sorted(comp))

    for v in graph:
        if v not in index:
            visit(v)
    assert cycles == []


def test_the_library_never_calls_the_command_line() -> None:
    """Only ``cli/`` (and ``__main__``) imports the command line; the library trains through functions, not argv."""
    offenders = [name_of(p) for p in modules() if "cli" not in p.relative_to(SRC).parts and p.name != "__main__.py"
                 and any(m.startswith("blocktrain.cli") for m in runtime_imports(p))]
    assert offenders == []
    spawners = [name_of(p) for p in modules() if re.search(r'"-m",\s*"blocktrain",\s*"train', p.read_text())]
    assert spawners == []  # no training started as `python -m blocktrain train...` (train.child.train_arm instead)


COORDINATOR_FRONT = {"service.py", "app.py", "polls.py"}  # the lock's owner, the HTTP layer over it and its shared
# status documents (each with its own lock, taken before the coordinator's)
MUTATORS = {"append", "appendleft", "extend", "add", "update", "setdefault", "pop", "popleft", "clear", "discard",
            "remove", "insert"}


def test_no_coordinator_part_takes_a_lock_or_writes_another_parts_state() -> None:
    """Only the front takes the shared lock (no part creates, takes or is handed one); a part changes another part's
    state only through that part's methods: no ``self.<part>.<attr> = ...`` and no ``self.<part>.<attr>.append(...)``."""
    offenders: dict[str, list[str]] = {}
    for path in modules("coordinator"):
        if path.name in COORDINATOR_FRONT:
            continue
        tree = ast.parse(path.read_text())
        found = []
        for node in ast.walk(tree):
            text = ast.unparse(node) if isinstance(node, ast.expr | ast.stmt) else ""
            if isinstance(node, ast.Call) and re.search(r"\b(R?Lock|Semaphore|Condition)\(", ast.unparse(node.func) + "("):
                found.append(f"line {node.lineno}: creates {ast.unparse(node.func)}")
            if isinstance(node, ast.With) and "lock" in text.split(":")[0].lower():
                found.append(f"line {node.lineno}: takes a lock")
            if isinstance(node, ast.arg) and node.arg == "lock":
                found.append(f"line {node.lineno}: is handed a lock")
            targets = node.targets if isinstance(node, ast.Assign) else [node.target] if isinstance(node, ast.AugAssign) else []
            for t in targets:
                while isinstance(t, ast.Subscript):
                    t = t.value
                if isinstance(t, ast.Attribute) and _through_another_part(t.value):
                    found.append(f"line {cast(ast.stmt, node).lineno}: assigns {ast.unparse(t)}")
            if (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr in MUTATORS
                    and isinstance(node.func.value, ast.Attribute) and _through_another_part(node.func.value.value)):
                found.append(f"line {node.lineno}: mutates {ast.unparse(node.func.value)}")
        if found:
            offenders[name_of(path)] = found
    assert offenders == {}


def _through_another_part(node: ast.expr) -> bool:
    """``self.<x>``: an attribute of another object this part holds (its own state is ``self.<x>`` itself)."""
    return isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) and node.value.id == "self"


def test_no_sqlite_row_leaves_the_tables() -> None:
    """Table accessors return frozen row types; only ``coordinator/db.py``, ``tables.py``, ``conduct_tables.py`` and
    ``rows.py`` (whose ``of`` builds a row type from one) see ``sqlite3.Row``, and no public method of the tables or
    ``rows.py`` returns one."""
    allowed = {("coordinator", "db.py"), ("coordinator", "tables.py"), ("coordinator", "conduct_tables.py"),
               ("coordinator", "rows.py")}
    named = [name_of(p) for p in modules() if "sqlite3.Row" in p.read_text() and (p.parent.name, p.name) not in allowed]
    assert named == []
    leaking = []
    for name in ("tables.py", "conduct_tables.py", "rows.py"):
        tree = ast.parse((SRC / "coordinator" / name).read_text())
        leaking += [f"{cls.name}.{fn.name}" for cls in tree.body if isinstance(cls, ast.ClassDef) for fn in cls.body
                    if isinstance(fn, ast.FunctionDef) and not fn.name.startswith("_") and fn.returns is not None
                    and "sqlite3.Row" in ast.unparse(fn.returns)]
    assert leaking == []


def test_no_coordinator_route_returns_a_bare_dict() -> None:
    """Every JSON route of the coordinator returns a model (``response_model``), not ``dict[str, Any]``."""
    tree = ast.parse((SRC / "coordinator" / "app.py").read_text())
    routes = [fn for fn in ast.walk(tree) if isinstance(fn, ast.AsyncFunctionDef)
              and any("app." in ast.unparse(d) for d in fn.decorator_list)]
    assert routes and [fn.name for fn in routes if fn.returns is not None and "dict" in ast.unparse(fn.returns)] == []



def test_every_source_folder_is_a_package_an_install_ships() -> None:
    """setuptools' find (pyproject.toml) ships only folders with an __init__.py: a folder without one would be
    missing from a non-editable install (coordinator/ and worker/ were)."""
    from setuptools import find_packages

    src = Path(__file__).resolve().parents[1] / "src"
    folders = {str(p.parent.relative_to(src)).replace("/", ".") for p in src.rglob("*.py")}
    assert folders <= set(find_packages(str(src))), sorted(folders - set(find_packages(str(src))))


def test_every_module_a_docstring_names_exists() -> None:
    """A ``:mod:`` reference in the package's source, relative (``.intake``) or absolute (``blocktrain.data``), names a
    module or package that exists: ``coordinator/simulate.py`` cited ``.defences``, a module long since renamed."""
    missing = []
    for path in SRC.rglob("*.py"):
        text = path.read_text()
        for name in re.findall(r":mod:`~?\.([A-Za-z_][\w.]*)`", text):
            base = path.parent / name.split(".")[0]
            if not (base.with_suffix(".py").exists() or (base / "__init__.py").exists()):
                missing.append(f"{path.relative_to(SRC)}: .{name}")
        for name in re.findall(r":mod:`~?blocktrain\.([\w.]+)`", text):
            base = SRC.joinpath(*name.split("."))
            if not (base.with_suffix(".py").exists() or (base / "__init__.py").exists()):
                missing.append(f"{path.relative_to(SRC)}: blocktrain.{name}")
    assert not missing, missing
