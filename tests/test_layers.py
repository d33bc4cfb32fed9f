"""The package's layers (docs/architecture.md, "Layers"): every ``mtbert`` module imports
only from its own layer or the layers below, and the imports between ``mtbert`` modules --
at module level or inside a function -- form no cycle.  An import inside a function is
there only to defer a heavy or optional package, and says which (``# deferred: torch``),
which the imported module really imports.

Read from the source with ``ast``: nothing is imported, Ray least of all."""

from __future__ import annotations

import ast
import re
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parents[1] / "mtbert"

#: the trainer's packages, bottom to top; a module imports from its own layer and the ones
#: below.  Every layer is a package, read from the tree (:func:`trainer_layers`,
#: :func:`tune_layers`), so that the docs' table (checked against this) follows the tree:
#: ``mtbert``'s own ``__init__`` is in the bottom layer, its top-level modules (``train.py``)
#: in the commands layer
TRAINER_PACKAGES = ["core", "data", "model", "techniques", "run", "step", "loop"]
#: mtbert/tune's packages, bottom to top; its own top-level modules (the command line, the
#: settings, the driver) are the commands layer with ``mtbert.train``
TUNE_PACKAGES = ["trial", "search", "infra", "results"]


def package_layers(folder: Path, order: list[str], prefix: str,
                   root: Path = PACKAGE) -> list[tuple[str, list[str]]]:
    """One layer per package of ``folder`` in ``order`` (every module under it, sub-packages
    included), named ``prefix + package``."""
    found = sorted(p.name for p in folder.iterdir() if (p / "__init__.py").is_file())
    assert found == sorted(order), (
        f"{folder.relative_to(root.parent)}'s packages {found} are not {order}: give a new "
        "package its place in the order")
    modules = package_modules(root)
    dotted = module_name(folder / "__init__.py", root)
    return [(f"{prefix}{pkg}", sorted(m for m in modules if m.startswith(f"{dotted}.{pkg}.")
                                      or m == f"{dotted}.{pkg}"))
            for pkg in order]


def trainer_layers(root: Path = PACKAGE) -> list[tuple[str, list[str]]]:
    """The trainer's layers from the tree: one per package of mtbert but tune/, ``mtbert``
    itself in the bottom one."""
    layers = package_layers(root, [*TRAINER_PACKAGES, "tune"], "", root)[:-1]
    (name, members), *rest = layers
    return [(name, ["mtbert", *members]), *rest]


def tune_layers(root: Path = PACKAGE) -> list[tuple[str, list[str]]]:
    """The search's layers from the tree: one per package of mtbert/tune, then the
    commands: mtbert's and mtbert/tune's top-level modules."""
    modules = package_modules(root)
    top = sorted(m for m, path in modules.items() if path.parent == root / "tune"
                 or path.parent == root and path.name != "__init__.py")
    return package_layers(root / "tune", TUNE_PACKAGES, "tune: ", root) + [("commands", top)]


def all_layers(root: Path = PACKAGE) -> list[tuple[str, list[str]]]:
    return trainer_layers(root) + tune_layers(root)


#: what an in-function import may defer (tests/test_cli_startup.py's, and the extras')
HEAVY = {"ray", "mlflow", "optuna", "torch", "transformers", "matplotlib", "pandas", "scipy",
         "pyarrow", "sklearn", "hpbandster", "ConfigSpace"}
_DEFERRED = re.compile(r"#\s*deferred:\s*([A-Za-z_][\w.]*(?:\s*,\s*[A-Za-z_][\w.]*)*)")


@dataclass(frozen=True)
class Import:
    source: str          # the importing module
    target: str          # the mtbert module imported
    line: int
    in_function: bool
    deferred: frozenset[str]   # the packages its ``# deferred:`` comment names


def module_name(path: Path, root: Path = PACKAGE) -> str:
    parts = path.relative_to(root.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def package_modules(root: Path = PACKAGE) -> dict[str, Path]:
    return {module_name(p, root): p for p in sorted(root.rglob("*.py"))}


def _targets(node: ast.Import | ast.ImportFrom, source: str, is_package: bool,
             modules: set[str]) -> list[str]:
    """The package modules one import statement names (a module, or a package and the
    submodules taken from it)."""
    if isinstance(node, ast.Import):
        names = [alias.name for alias in node.names]
    else:
        base = node.module or ""
        if node.level:
            parts = source.split(".")[:len(source.split(".")) - node.level + is_package]
            base = ".".join(parts + ([base] if base else []))
        subs = [f"{base}.{alias.name}" for alias in node.names]
        names = [s for s in subs if s in modules] or [base]
    return [n for n in names if n in modules and n != source]


def _third_party(node: ast.Import | ast.ImportFrom) -> set[str]:
    if isinstance(node, ast.Import):
        return {alias.name.split(".")[0] for alias in node.names}
    return {node.module.split(".")[0]} if node.module and not node.level else set()


def _deferred(block: list[ast.stmt], lines: list[str]) -> frozenset[str]:
    """The packages a ``# deferred:`` comment names on the lines of a run of import
    statements or on the comment lines right above it."""
    first, last = block[0].lineno, block[-1].end_lineno or block[-1].lineno
    while first > 1 and lines[first - 2].strip().startswith("#"):
        first -= 1
    names: set[str] = set()
    for text in lines[first - 1:last]:
        for match in _DEFERRED.finditer(text):
            names |= {n.strip().split(".")[0] for n in match.group(1).split(",")}
    return frozenset(names)


def _import_runs(body: list[ast.stmt]):
    """Runs of consecutive import statements in one statement list."""
    run: list[ast.stmt] = []
    for stmt in body:
        if isinstance(stmt, (ast.Import, ast.ImportFrom)):
            run.append(stmt)
            continue
        if run:
            yield run
        run = []
    if run:
        yield run


def scan(path: Path, source: str, modules: set[str]) -> tuple[list[Import], set[str]]:
    """(the mtbert imports of one module, the top-level packages it imports at module
    level)."""
    text = path.read_text(encoding="utf-8")
    tree, lines = ast.parse(text), text.splitlines()
    is_package = path.name == "__init__.py"
    found: list[Import] = []
    module_level: set[str] = set()

    def visit(node: ast.AST, in_function: bool) -> None:
        for field in ("body", "orelse", "finalbody", "handlers"):
            body = getattr(node, field, None)
            if not isinstance(body, list):
                continue
            stmts = [s for s in body if isinstance(s, ast.stmt)]
            for run in _import_runs(stmts):
                deferred = _deferred(run, lines) if in_function else frozenset()
                for stmt in run:
                    if not in_function and not _type_checking(node):
                        module_level.update(_third_party(stmt))
                    for target in _targets(stmt, source, is_package, modules):
                        found.append(Import(source, target, stmt.lineno, in_function,
                                            deferred))
            for child in body:
                inner = in_function or isinstance(child, (ast.FunctionDef,
                                                          ast.AsyncFunctionDef, ast.Lambda))
                if isinstance(child, ast.AST) and not isinstance(child, (ast.Import,
                                                                         ast.ImportFrom)):
                    visit(child, inner)
    visit(tree, False)
    return found, module_level


def _type_checking(node: ast.AST) -> bool:
    return isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test)


def import_graph(root: Path = PACKAGE):
    modules = package_modules(root)
    imports: list[Import] = []
    packages: dict[str, set[str]] = {}
    for name, path in modules.items():
        found, module_level = scan(path, name, set(modules))
        imports += found
        packages[name] = module_level
    return modules, imports, packages


def cycles(imports: list[Import]) -> list[list[str]]:
    """The import cycles: each strongly connected group of modules (Tarjan), sorted."""
    edges: dict[str, set[str]] = {}
    for imp in imports:
        edges.setdefault(imp.source, set()).add(imp.target)
        edges.setdefault(imp.target, set())
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    groups: list[list[str]] = []

    def connect(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in sorted(edges[v]):
            if w not in index:
                connect(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            group = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                group.append(w)
                if w == v:
                    break
            if len(group) > 1:
                groups.append(sorted(group))

    limit = sys.getrecursionlimit()
    sys.setrecursionlimit(max(limit, 10 * len(edges) + 100))
    try:
        for v in sorted(edges):
            if v not in index:
                connect(v)
    finally:
        sys.setrecursionlimit(limit)
    return sorted(groups)


def layer_of() -> dict[str, int]:
    return {m: i for i, (_, members) in enumerate(all_layers()) for m in members}


def upward(imports: list[Import]) -> list[str]:
    layer, layers = layer_of(), all_layers()
    return [f"{i.source} ({layers[layer[i.source]][0]}) imports {i.target} "
            f"({layers[layer[i.target]][0]}), line {i.line}"
            for i in imports if layer[i.target] > layer[i.source]]


def transitive_packages(modules, imports, packages) -> dict[str, set[str]]:
    """What importing each module loads: its module-level packages and those of the
    mtbert modules it imports at module level, transitively."""
    deps: dict[str, set[str]] = {m: set() for m in modules}
    for imp in imports:
        if not imp.in_function:
            deps[imp.source].add(imp.target)
    out: dict[str, set[str]] = {}

    def loads(m: str, seen: set[str]) -> set[str]:
        if m in out:
            return out[m]
        found = set(packages[m])
        for d in deps[m] - seen:
            found |= loads(d, seen | {m})
        out[m] = found
        return found
    for m in modules:
        loads(m, {m})
    return out


def bad_in_function_imports(modules, imports, packages) -> list[str]:
    loaded = transitive_packages(modules, imports, packages)
    bad = []
    for imp in imports:
        if not imp.in_function:
            continue
        where = f"{imp.source} line {imp.line}: in-function import of {imp.target}"
        named = imp.deferred & HEAVY
        if not named:
            bad.append(f"{where} defers no heavy package (say which: '# deferred: torch'), "
                       "or move it to module level")
        elif not named & loaded[imp.target]:
            bad.append(f"{where} says it defers {', '.join(sorted(named))}, which "
                       f"{imp.target} does not import (it loads "
                       f"{', '.join(sorted(loaded[imp.target] & HEAVY)) or 'none of them'})")
    return bad


# ---------------------------------------------------------------------- the package
@pytest.fixture(scope="module")
def graph():
    return import_graph()


def test_every_module_has_a_layer(graph):
    modules, _, _ = graph
    layer = layer_of()
    assert sorted(set(modules) - set(layer)) == []
    assert sorted(set(layer) - set(modules)) == []


def test_no_import_cycle(graph):
    _, imports, _ = graph
    assert cycles(imports) == []


def test_imports_point_downward(graph):
    _, imports, _ = graph
    assert upward(imports) == []


def test_in_function_imports_defer_a_heavy_package(graph):
    assert bad_in_function_imports(*graph) == []


def test_the_trainer_never_imports_the_search(graph):
    _, imports, packages = graph
    core = {m for m in packages if not m.startswith("mtbert.tune")}
    assert [i for i in imports if i.source in core and i.target.startswith("mtbert.tune")] == []
    assert {m: packages[m] & {"ray", "optuna", "mlflow"} for m in core
            if packages[m] & {"ray", "optuna", "mlflow"}} == {}


def test_a_ray_worker_needs_no_command_line_module(graph):
    """The trainable reaches the trial-config merge without the CLI's settings module or
    the Tuner's (tuner.py)."""
    _, imports, _ = graph
    reached, todo = set(), ["mtbert.tune.trial.trainable"]
    while todo:
        m = todo.pop()
        for i in imports:
            if i.source == m and i.target not in reached:
                reached.add(i.target)
                todo.append(i.target)
    assert reached.isdisjoint({"mtbert.tune.settings", "mtbert.tune.search.tuner",
                               "mtbert.tune.cli", "mtbert.tune.driver"})


def docs_layers() -> dict[str, set[str]]:
    """docs/architecture.md's layer table: each layer and the modules its row names."""
    text = (PACKAGE.parent / "docs" / "architecture.md").read_text(encoding="utf-8")
    names = [name for name, _ in all_layers()]
    table: dict[str, set[str]] = {}
    for line in text.splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if not line.startswith("|") or cells[0] not in names:
            continue
        prefix = "mtbert.tune." if cells[0].startswith("tune") else "mtbert."
        table[cells[0]] = {prefix + f.replace("/", ".")
                           for f in re.findall(r"`([\w/]+)\.py`", cells[1])}
    return table


def test_the_docs_layer_table_is_this_one():
    """The table names each module in the layer it is in (the packages' ``__init__``
    modules aside): every module of the tree is named, and every module named exists."""
    packages = {m for m, path in package_modules().items() if path.name == "__init__.py"}
    assert docs_layers() == {name: set(members) - packages for name, members in all_layers()}


def test_no_function_is_longer_than_80_lines():
    """What a reader takes in at once (the layering's acceptance): decorators and docstrings
    included."""
    long = []
    for path in sorted(PACKAGE.rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                first = min([node.lineno, *(d.lineno for d in node.decorator_list)])
                if node.end_lineno - first + 1 > 80:
                    long.append(f"{module_name(path)}.{node.name}: "
                                f"{node.end_lineno - first + 1} lines")
    assert long == []


# ---------------------------------------------------------------------- the checker
def _write(root: Path, files: dict[str, str]) -> Path:
    for rel, text in files.items():
        path = root / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text, encoding="utf-8")
    return root / "mtbert"


def test_a_cycle_through_an_in_function_import_is_found(tmp_path):
    root = _write(tmp_path, {"mtbert/__init__.py": "", "mtbert/a.py": "from mtbert.b import x\n",
                             "mtbert/b.py": "def f():\n    from mtbert import a\n"})
    _, imports, _ = import_graph(root)
    assert cycles(imports) == [["mtbert.a", "mtbert.b"]]


def test_an_in_function_import_must_say_what_it_defers(tmp_path):
    root = _write(tmp_path, {
        "mtbert/__init__.py": "", "mtbert/heavy.py": "import torch\n",
        "mtbert/light.py": "import json\n",
        "mtbert/user.py": ("def f():\n    from mtbert.light import x\n\n"
                           "def g():\n    from mtbert.light import x  # deferred: torch\n\n"
                           "def h():\n    # deferred: torch\n    import json\n"
                           "    from mtbert.heavy import y\n")})
    bad = bad_in_function_imports(*import_graph(root))
    assert len(bad) == 2
    assert "line 2" in bad[0] and "defers no heavy package" in bad[0]
    assert "line 5" in bad[1] and "which mtbert.light does not import" in bad[1]


def test_an_upward_import_is_reported():
    imports = [Import("mtbert.tune.search.tuner", "mtbert.tune.results.records", 3, False,
                      frozenset())]
    assert upward(imports) == ["mtbert.tune.search.tuner (tune: search) imports "
                               "mtbert.tune.results.records (tune: results), line 3"]


def test_an_upward_import_between_the_trainer_s_folders_is_reported():
    imports = [Import("mtbert.run.trial_run", "mtbert.step.step_engine", 7, False, frozenset())]
    assert upward(imports) == ["mtbert.run.trial_run (run) imports mtbert.step.step_engine "
                               "(step), line 7"]


def test_a_new_folder_needs_its_place_in_the_order(tmp_path):
    root = _write(tmp_path, {f"mtbert/{pkg}/__init__.py": ""
                             for pkg in [*TRAINER_PACKAGES, "tune", "extra"]})
    with pytest.raises(AssertionError, match="give a new package its place"):
        trainer_layers(root)


def readme_layout_paths() -> set[str]:
    """The paths under mtbert/ README's layout names: its code block, read by indentation
    (``name/`` a folder, ``name.py`` a module in the folder above it); a folder ends in /."""
    text = (PACKAGE.parent / "README.md").read_text(encoding="utf-8")
    block = text.split("## Layout", 1)[1].split("```", 2)[1]
    stack: list[tuple[int, str]] = []
    found = set()
    for line in block.splitlines():
        match = re.match(r"^( *)([\w.]+/?)\s", line + " ")
        if not match or not (match.group(2).endswith("/") or match.group(2).endswith(".py")):
            continue
        indent, name = len(match.group(1)), match.group(2)
        while stack and stack[-1][0] >= indent:
            stack.pop()
        path = "/".join([s for _, s in stack] + [name])
        if name.endswith("/"):
            stack.append((indent, name.rstrip("/")))
        if path.startswith("mtbert/"):
            found.add(path)
    return found


def test_readme_s_layout_names_every_folder_and_only_those():
    """README names mtbert's folders (every package, sub-packages included) and may name a
    module; docs/architecture.md's layer table names every module."""
    root = PACKAGE.parent
    folders = {f"{p.parent.relative_to(root).as_posix()}/" for p in PACKAGE.rglob("__init__.py")}
    named = readme_layout_paths()
    assert sorted(folders - named) == [], "README's layout leaves these folders out"
    assert sorted(p for p in named - folders if not (p.endswith(".py") and (root / p).is_file())) \
        == [], "README names folders or modules that do not exist"
