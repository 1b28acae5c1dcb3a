"""Imports run one way: the package graph of twospeed, read from every module's AST (imports inside functions
included: a lazy import is still an arrow), has no arrow that the layering below does not allow and no cycle.

A package is a folder under twospeed/ (model, engine, ...) or a top-level module (config, llm, report, cli);
`twospeed` itself is the package's front door (twospeed/__init__.py: LLM, SamplingParams, Clock, Bill).
"""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1] / "twospeed"

# Bottom to top: schema and config <- model <- builtin <- engine <- serving <- server <- cluster. The lab and the
# planner use what the engine and serving use and never server/ or cli (plan reads lab/'s results, never the other
# way). llm.py (LLM) and report.py (tables of finished requests) sit on the engine; cli.py is the top and nothing
# imports it. Each package may import exactly the packages listed for it.
_CORE = {"schema", "config"}
_BELOW_ENGINE = _CORE | {"model", "builtin"}
_ENGINE = _BELOW_ENGINE | {"engine"}
ALLOWED: dict[str, set[str]] = {
    "schema": set(),
    "config": {"schema"},
    "model": _CORE,
    "builtin": _CORE | {"model"},
    "engine": _BELOW_ENGINE,
    "llm": _ENGINE,
    "report": _ENGINE,
    "serving": _ENGINE,
    "server": _ENGINE | {"serving"},
    "cluster": _ENGINE | {"serving", "server"},
    "lab": _ENGINE | {"serving"},
    "plan": _ENGINE | {"serving", "lab"},
    "twospeed": _ENGINE | {"llm"},
    "cli": _ENGINE | {"llm", "report", "serving", "server", "cluster", "lab", "plan", "twospeed"},
}

Graph = dict[str, dict[str, list[str]]]  # package -> imported package -> where ("module:line imports name")


def package_of(module: str) -> str:
    """twospeed.engine.request -> engine; twospeed.config -> config; twospeed -> twospeed."""
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else parts[0]


def module_name(path: Path, root: Path) -> str:
    rel = path.relative_to(root.parent).with_suffix("")
    parts = rel.parts[:-1] if rel.name == "__init__" else rel.parts
    return ".".join(parts)


def imported_modules(tree: ast.AST, module: str, is_package: bool, known: set[str]) -> list[tuple[str, int]]:
    """Every twospeed module `tree` imports, anywhere in it, with its line. `from twospeed import X` names the
    module X where there is one, else the front door."""
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found += [(a.name, node.lineno) for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:  # relative: from the module's own package up
                here = module.split(".") if is_package else module.split(".")[:-1]
                base = ".".join(here[:len(here) - node.level + 1] + ([base] if base else []))
            for a in node.names:
                full = f"{base}.{a.name}"
                found.append((full if full in known else base, node.lineno))
    return [(name, line) for name, line in found if name == "twospeed" or name.startswith("twospeed.")]


def import_graph(root: Path = ROOT) -> Graph:
    """The package graph of every module under `root` (arrows between different packages only)."""
    files = sorted(root.rglob("*.py"))
    known = {module_name(f, root) for f in files}
    graph: Graph = {}
    for f in files:
        module = module_name(f, root)
        src = package_of(module)
        graph.setdefault(src, {})
        tree = ast.parse(f.read_text(), str(f))
        for name, line in imported_modules(tree, module, f.name == "__init__.py", known):
            dst = package_of(name)
            if dst != src:
                graph[src].setdefault(dst, []).append(f"{module}:{line} imports {name}")
    return graph


def upward_arrows(graph: Graph, allowed: dict[str, set[str]]) -> list[str]:
    """Each arrow the layering does not allow, with where it is; a package the layering does not name is one."""
    bad = []
    for src, arrows in sorted(graph.items()):
        if src not in allowed:
            bad.append(f"package {src!r} has no place in the layering (tests/test_import_graph.py ALLOWED)")
            continue
        for dst, where in sorted(arrows.items()):
            if dst not in allowed[src]:
                bad.append(f"{src} -> {dst}: {'; '.join(where)}")
    return bad


def cycles(graph: Graph) -> list[list[str]]:
    """The graph's strongly connected components of more than one package (Tarjan), each sorted."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in graph.get(v, {}):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return sorted(found)


def test_no_upward_arrows():
    graph = import_graph()
    assert {"model", "builtin", "engine", "serving", "server", "lab", "plan", "cli"} <= set(graph)
    assert upward_arrows(graph, ALLOWED) == []


def test_no_cycles_between_packages():
    assert cycles(import_graph()) == []


def test_the_layering_itself_has_no_cycle_and_nothing_imports_cli():
    assert cycles({src: {dst: [] for dst in dsts} for src, dsts in ALLOWED.items()}) == []
    assert not any("cli" in dsts for dsts in ALLOWED.values())


def test_the_checker_reports_an_upward_arrow_and_a_cycle(tmp_path):
    # a fake twospeed: model's task model reads the lab's corpus, inside a function; the lab imports the model back
    pkg = tmp_path / "twospeed"
    for folder in ("model", "lab", "engine"):
        (pkg / folder).mkdir(parents=True)
        (pkg / folder / "__init__.py").write_text("")
    (pkg / "__init__.py").write_text("")
    (pkg / "model" / "task.py").write_text("def corpus():\n    from twospeed.lab import corpus\n    return corpus\n")
    (pkg / "lab" / "corpus.py").write_text("from .. import model\nfrom twospeed.model.task import corpus\n")
    (pkg / "engine" / "run.py").write_text("import twospeed.model.task as task\n")
    graph = import_graph(pkg)
    assert graph["model"] == {"lab": ["twospeed.model.task:2 imports twospeed.lab.corpus"]}
    assert graph["lab"] == {"model": ["twospeed.lab.corpus:1 imports twospeed.model",
                                      "twospeed.lab.corpus:2 imports twospeed.model.task"]}
    assert graph["engine"] == {"model": ["twospeed.engine.run:1 imports twospeed.model.task"]}
    assert upward_arrows(graph, ALLOWED) == ["model -> lab: twospeed.model.task:2 imports twospeed.lab.corpus"]
    assert cycles(graph) == [["lab", "model"]]
    assert upward_arrows({"extras": {}}, ALLOWED) == [
        "package 'extras' has no place in the layering (tests/test_import_graph.py ALLOWED)"]
