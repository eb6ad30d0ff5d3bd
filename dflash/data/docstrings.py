"""Coding tasks from documented Python code that ships with the interpreter and with
installed packages: each documented public function, method or class becomes a request
to implement, explain or test it, with its documentation as the specification.

The source is read with :mod:`ast`, never imported, so no module's import-time side
effects run and any file the interpreter can parse is usable. What is kept is decided
by the code alone (public names, a docstring of some substance), and the order is the
files' sorted order, so the same interpreter and packages give the same tasks.
"""

from __future__ import annotations

import ast
import hashlib
import importlib.util
import sysconfig
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

MIN_DOC_CHARS = 40  # shorter docstrings ("Return x.") specify nothing
MAX_DOC_CHARS = 900  # the first paragraphs; a module's worth of reference text is not a task
SKIP_DIRS = {"test", "tests", "testing", "idlelib", "lib2to3", "site-packages", "dist-packages", "__pycache__",
             "turtledemo", "ensurepip", "_vendor", "vendored", "tkinter", "pydoc_data", "encodings"}


@dataclass(frozen=True)
class Documented:
    """One documented definition: where it is, what it is called, how it is called."""

    module: str  # dotted, e.g. "json.decoder"
    qualname: str  # "JSONDecoder.decode"
    kind: str  # "function", "method" or "class"
    signature: str  # "(self, s, _w=...)" without annotations' noise
    doc: str

    @property
    def name(self) -> str:
        return self.qualname.rsplit(".", 1)[-1]


def stdlib_root() -> Path:
    return Path(sysconfig.get_paths()["stdlib"])


def package_roots(names: list[str]) -> tuple[list[tuple[str, Path]], list[str]]:
    """``(name, directory)`` of each installed package of ``names``, and the names not installed."""
    found, missing = [], []
    for name in names:
        spec = importlib.util.find_spec(name)
        locations = list(spec.submodule_search_locations or []) if spec else []
        if locations:
            found.append((name, Path(locations[0])))
        elif spec and spec.origin and spec.origin.endswith(".py"):
            found.append((name, Path(spec.origin)))
        else:
            missing.append(name)
    return found, missing


def python_files(root: Path) -> Iterator[Path]:
    """The ``.py`` files under ``root`` in sorted order, without tests, vendored copies and
    private modules."""
    if root.is_file():
        yield root
        return
    for path in sorted(root.rglob("*.py")):
        parts = path.relative_to(root).parts
        if any(p in SKIP_DIRS or (p.startswith("_") and p != "__init__.py") for p in parts):
            continue
        yield path


def module_name(prefix: str, root: Path, path: Path) -> str:
    if root.is_file():
        return prefix
    parts = list(path.relative_to(root).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(([prefix] if prefix else []) + parts)


def trim_doc(doc: str) -> str:
    """The leading paragraphs up to :data:`MAX_DOC_CHARS`, whole paragraphs only."""
    kept, size = [], 0
    for paragraph in doc.strip().split("\n\n"):
        if kept and size + len(paragraph) > MAX_DOC_CHARS:
            break
        kept.append(paragraph.rstrip())
        size += len(paragraph) + 2
    return "\n\n".join(kept)[:MAX_DOC_CHARS * 2]


def _signature(node: ast.FunctionDef | ast.AsyncFunctionDef) -> str:
    args = node.args
    for arg in [*args.posonlyargs, *args.args, *args.kwonlyargs, args.vararg, args.kwarg]:
        if arg is not None:
            arg.annotation = None
    defaults = [ast.Constant(value=...) if not isinstance(d, ast.Constant) else d for d in args.defaults]
    args.defaults = defaults
    args.kw_defaults = [None if d is None else (d if isinstance(d, ast.Constant) else ast.Constant(value=...))
                        for d in args.kw_defaults]
    return f"({ast.unparse(args)})"


def documented_in(source: str, module: str) -> Iterator[Documented]:
    """The documented public top-level functions and classes of one module, and the
    documented public methods of its public classes."""
    try:
        tree = ast.parse(source)
    except (SyntaxError, ValueError):
        return
    for node in tree.body:
        # only definitions: other statements may carry a ``name`` that is no string
        # (``type X = ...``, Python 3.12's ``ast.TypeAlias``, holds an ``ast.Name``)
        if not isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)) or node.name.startswith("_"):
            continue
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            yield from _documented(node, module, node.name, "function")
        elif isinstance(node, ast.ClassDef):
            yield from _documented(node, module, node.name, "class")
            for child in node.body:
                if isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef)) and not child.name.startswith("_"):
                    yield from _documented(child, module, f"{node.name}.{child.name}", "method")


def _documented(node, module: str, qualname: str, kind: str) -> Iterator[Documented]:
    doc = ast.get_docstring(node)
    if not doc or len(doc.strip()) < MIN_DOC_CHARS or not any(c.isalpha() for c in doc):
        return
    if kind == "class":
        init = next((n for n in node.body if isinstance(n, ast.FunctionDef) and n.name == "__init__"), None)
        signature = _signature(init) if init is not None else "()"
    else:
        signature = _signature(node)
    yield Documented(module, qualname, kind, signature, trim_doc(doc))


def collect(roots: list[tuple[str, Path]]) -> list[Documented]:
    """Every :class:`Documented` under each ``(module prefix, directory)``, deduplicated
    by name and documentation (re-exports and copies)."""
    seen, found = set(), []
    for prefix, root in roots:
        for path in python_files(root):
            try:
                source = path.read_text(encoding="utf-8")
            except (OSError, UnicodeDecodeError):
                continue
            for item in documented_in(source, module_name(prefix, root, path)):
                key = (item.name, item.doc[:200])
                if key not in seen:
                    seen.add(key)
                    found.append(item)
    return found


def _pick(key: str, n: int) -> int:
    return int.from_bytes(hashlib.sha256(key.encode()).digest()[:4], "little") % n


def task(item: Documented) -> str:
    """One user request about ``item``; which kind of request follows from its name, so
    the same definition always gives the same task."""
    where = f"{item.module}.{item.qualname}"
    fenced = f"\n\n\"\"\"\n{item.doc}\n\"\"\""
    if item.kind == "class":
        return [
            f"Implement a Python class `{item.name}`, constructed as `{item.name}{item.signature}`, as described "
            f"by this docstring:{fenced}",
            f"Explain what the class `{where}` is for and show how to use it in a short example. Its "
            f"documentation reads:{fenced}",
        ][_pick(where, 2)]
    call = f"{item.name}{item.signature}"
    return [
        f"Write a Python function `{call}` that does what this docstring says:{fenced}",
        f"Explain what `{where}` does, step by step, and give a short example of calling it. Its documentation "
        f"reads:{fenced}",
        f"Write pytest unit tests for `{where}{item.signature}`, covering normal use and edge cases. Its "
        f"documentation reads:{fenced}",
    ][_pick(where, 3)]
