"""The docs against the tree: ARCHITECTURE.md names every module and only modules that exist, README.md stays a
front door, and every relative link in README.md and docs/ resolves.

ARCHITECTURE.md's convention (stated at its top): a module is named by its path relative to twospeed/
(`engine/scheduler.py`, `config.py`); a package's __init__.py by the package itself (`engine/`). A path that does
not resolve under twospeed/ may name a file of the repository (`deploy/make_grafana.py`). Why a test: modules move,
and a map that names a module which is gone, or misses one that came, misleads the next reader more than no map.
"""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PACKAGE = ROOT / "twospeed"
ARCHITECTURE = ROOT / "docs" / "ARCHITECTURE.md"
README = ROOT / "README.md"
README_MAX_LINES = 250

# A .py path as the docs write it: `engine/scheduler.py`, `config.py`, `deploy/make_grafana.py`.
PY_PATH = re.compile(r"(?<![\w./*-])((?:[\w.-]+/)*\w+\.py)(?!\w)")
# A package as the layout names it: `engine/` standing alone (not the head of `engine/scheduler.py`).
PACKAGE_PATH = re.compile(r"(?<![\w./*-])((?:\w+/)+)(?![\w*.])")
# A markdown link's target: [text](target).
LINK = re.compile(r"\[[^\]]*\]\(([^)\s]+)\)")


def modules() -> list[str]:
    """Every module under twospeed/, as a path relative to it."""
    return sorted(p.relative_to(PACKAGE).as_posix() for p in PACKAGE.rglob("*.py") if "__pycache__" not in p.parts)


def named_paths(text: str) -> set[str]:
    return set(PY_PATH.findall(text))


def named_packages(text: str) -> set[str]:
    return set(PACKAGE_PATH.findall(text))


def is_named(module: str, paths: set[str], packages: set[str]) -> bool:
    if module in paths:
        return True
    package, _, name = module.rpartition("/")
    return name == "__init__.py" and bool(package) and f"{package}/" in packages


def test_architecture_names_every_module():
    text = ARCHITECTURE.read_text()
    paths, packages = named_paths(text), named_packages(text)
    missing = [m for m in modules() if not is_named(m, paths, packages)]
    assert not missing, (f"docs/ARCHITECTURE.md does not name these modules (by their path relative to twospeed/; a "
                         f"package's __init__.py by `package/`): {missing}")


def test_every_module_path_architecture_names_exists():
    named = named_paths(ARCHITECTURE.read_text())
    gone = sorted(p for p in named if not (PACKAGE / p).is_file() and not (ROOT / p).is_file())
    assert not gone, f"docs/ARCHITECTURE.md names modules that do not exist (under twospeed/ or the repository): {gone}"


def test_readme_is_a_front_door():
    text = README.read_text()
    lines = text.count("\n") + (not text.endswith("\n"))
    assert lines <= README_MAX_LINES, f"README.md has {lines} lines; guides belong in docs/ (at most {README_MAX_LINES})"
    for command in ("make demo", "make test"):
        assert command in text, f"README.md must show `{command}`: the two set-up commands for a fresh machine"


def doc_files() -> list[Path]:
    return [README, *sorted((ROOT / "docs").glob("*.md"))]


def relative_links(path: Path) -> list[str]:
    """Targets of the links in a markdown file that point into the repository (no scheme, not a bare anchor)."""
    targets = LINK.findall(path.read_text())
    return [t for t in targets if not re.match(r"[a-zA-Z][a-zA-Z0-9+.-]*:", t) and not t.startswith("#")]


def test_every_relative_link_resolves():
    broken = []
    for doc in doc_files():
        for target in relative_links(doc):
            file = target.split("#", 1)[0]
            if not (doc.parent / file).exists():
                broken.append(f"{doc.relative_to(ROOT)}: {target}")
    assert not broken, f"links to files that do not exist: {broken}"


def test_the_patterns_read_the_convention():
    """The checks above are only as good as what the patterns pick out of the text."""
    text = ("`engine/scheduler.py` and config.py; the layout's\nengine/    one step\n"
            "model/csrc/*.c, server/static/dashboard.js, see [x](lab.md#a) and [y](https://example.org/z.md)")
    assert named_paths(text) == {"engine/scheduler.py", "config.py"}
    assert "engine/" in named_packages(text) and "model/" not in named_packages(text)
    assert is_named("engine/__init__.py", named_paths(text), named_packages(text))
    assert not is_named("model/__init__.py", named_paths(text), named_packages(text))
    assert LINK.findall(text) == ["lab.md#a", "https://example.org/z.md"]
