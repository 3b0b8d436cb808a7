"""The code's own conventions, declared once and held by tests: the layers, and no flags in the library.

Layers, ground first (a module imports only from its own layer and those below):

    errors, config < ops < runs < data < backends < core < scorefile < scoring, curate, calibrate < dedup, bench < training < lab < cli

Packages of one layer (`scoring`, `curate`, `calibrate`) stand side by side and do not import each other.
`tests/test_layers.py` holds every import statement of the package to `LAYERS` (deferred imports
inside functions and `TYPE_CHECKING` imports included) and docs/architecture.md prints
`layers_line()`. The library names config fields, never command-line flags (`errors.ConfigError`;
the CLI words fields as flags): `tests/test_flags.py` holds `flag_strings` of the library to none.
`benchmarks/architecture_stats.py` counts both at any revision.

Only the standard library: the checks read source text, they import nothing of pairclean.
"""

from __future__ import annotations

import ast
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Iterator

# Each entry is one layer: the top-level modules and packages of `pairclean` in it. The package
# root (`pairclean/__init__.py`: `__version__`, and exports imported lazily by name) is ground too.
LAYERS: tuple[tuple[str, ...], ...] = (
    ("", "errors", "config"),
    ("ops",),
    ("runs",),  # the resumable run's engine (part store, claims, the output guard once), for scoring, dedup, train
    ("data",),
    ("backends",),
    ("core",),
    ("scorefile",),
    ("scoring", "curate", "calibrate"),
    ("dedup", "bench"),  # dedup reads saved embeddings and a scores file; bench measures the scoring pipeline
    ("training",),
    ("lab",),
    ("cli",),
    ("__main__",),  # `python -m pairclean`: the command line, started
)

_UNSHOWN = {"", "__main__"}  # in a layer, but not what a reader of the order needs


def layers_line() -> str:
    """The declared order as one line, as docs/architecture.md prints it."""
    layers = [", ".join(name for name in layer if name not in _UNSHOWN) for layer in LAYERS]
    return " < ".join(layer for layer in layers if layer)


def sources(root: str | Path = ".") -> dict[str, str]:
    """{path relative to `root`: source} of every module of the pairclean package under `root`."""
    root = Path(root)
    return {path.relative_to(root).as_posix(): path.read_text() for path in sorted((root / "pairclean").rglob("*.py"))}


# ---------------------------------------------------------------- layers

def module_name(path: str) -> str:
    """`pairclean/a/b.py` -> `pairclean.a.b`; a package's `__init__.py` -> the package."""
    return path.removesuffix(".py").replace("/", ".").removesuffix(".__init__")


def part_of(module: str) -> str:
    """The top-level part of `pairclean` a dotted module name belongs to ('' for the root)."""
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else ""


def _declared(part: str) -> bool:
    return any(part in layer for layer in LAYERS)


def layer_of(module: str) -> int:
    part = part_of(module)
    for rank, layer in enumerate(LAYERS):
        if part in layer:
            return rank
    raise KeyError(f"{module} is in no layer: declare {part!r} in LAYERS (tests/conventions.py)")


@dataclass(frozen=True)
class Import:
    path: str  # the importing file, relative to the repository
    line: int
    module: str  # the importing module, dotted
    target: str  # the imported module, dotted

    def __str__(self) -> str:
        return (f"{self.path}:{self.line} imports {self.target}: "
                f"{part_of(self.module) or 'pairclean'} may not import {part_of(self.target)}")


def _import_statements(path: str, source: str) -> Iterator[tuple[ast.stmt, str, list[str]]]:
    """(statement, the module it imports from, the names it imports) of every import in a module,
    wherever it stands (top level, inside a function, under `if TYPE_CHECKING`); relative imports
    resolved against the module. `import a.b` imports from `a.b` and names nothing."""
    module = module_name(path)
    package = module.split(".") if path.endswith("__init__.py") else module.split(".")[:-1]
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            for alias in node.names:
                yield node, alias.name, []
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                base = ".".join(package[:len(package) - node.level + 1] + ([base] if base else []))
            yield node, base, [alias.name for alias in node.names]


def imports_of(path: str, source: str) -> list[Import]:
    """Every import of pairclean in a module, wherever it stands (top level, inside a function,
    under `if TYPE_CHECKING`); relative imports resolved against the module."""
    module = module_name(path)
    found = []
    for node, base, names in _import_statements(path, source):
        # `from pairclean import cli` imports a part; `from pairclean import __version__`, the root
        targets = [base] if base != "pairclean" or not names else \
            [f"pairclean.{name}" if _declared(name) else base for name in names]
        found += [Import(path, node.lineno, module, target) for target in targets
                  if target == "pairclean" or target.startswith("pairclean.")]
    return found


# ---------------------------------------------------------------- import cycles

def module_graph(files: dict[str, str]) -> dict[str, set[str]]:
    """module -> the modules of `files` it imports, every import statement counted (deferred ones
    inside functions and `TYPE_CHECKING` ones too): `from a import b` is an edge to the module
    `a.b` when there is one, else to `a`. (Python also runs a package's `__init__` before any of
    its modules; that implicit step is not an edge here, as it is not an import anyone wrote.)"""
    modules = {module_name(path): path for path in files}
    graph: dict[str, set[str]] = {module: set() for module in modules}
    for module, path in modules.items():
        for _, base, names in _import_statements(path, files[path]):
            targets = [f"{base}.{name}" if f"{base}.{name}" in modules else base for name in names] or [base]
            graph[module].update(t for t in targets if t in modules and t != module)
    return graph


def import_cycles(files: dict[str, str]) -> list[list[str]]:
    """The import cycles of `files`: every strongly connected component of the module graph with
    more than one module (a cycle hidden in a function is still a cycle), each sorted."""
    graph = module_graph(files)
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    cycles: list[list[str]] = []
    for root in sorted(graph):  # Tarjan's algorithm, iterative: a deep package needs no recursion limit
        if root in index:
            continue
        work = [(root, iter(sorted(graph[root])))]
        index[root] = low[root] = len(index)
        stack.append(root)
        on_stack.add(root)
        while work:
            node, edges = work[-1]
            step = next(edges, None)
            if step is not None:
                if step not in index:
                    index[step] = low[step] = len(index)
                    stack.append(step)
                    on_stack.add(step)
                    work.append((step, iter(sorted(graph[step]))))
                elif step in on_stack:
                    low[node] = min(low[node], index[step])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[node])
            if low[node] == index[node]:
                component = []
                while True:
                    member = stack.pop()
                    on_stack.discard(member)
                    component.append(member)
                    if member == node:
                        break
                if len(component) > 1:
                    cycles.append(sorted(component))
    return sorted(cycles)


# ---------------------------------------------------------------- records and handlers

def _names_dict(node: ast.expr) -> bool:
    if isinstance(node, ast.Constant) and isinstance(node.value, str):  # a quoted annotation
        try:
            node = ast.parse(node.value, mode="eval").body
        except SyntaxError:
            return False
    while isinstance(node, ast.Subscript):
        node = node.value
    return isinstance(node, ast.Name) and node.id in ("dict", "Dict")


def _returns_dict(annotation: ast.expr) -> bool:
    """`-> dict`, `-> dict[str, int]`, or a tuple holding one (`-> tuple[dict, dict]`)."""
    if isinstance(annotation, ast.Constant) and isinstance(annotation.value, str):
        try:
            annotation = ast.parse(annotation.value, mode="eval").body
        except SyntaxError:
            return False
    if _names_dict(annotation):
        return True
    if isinstance(annotation, ast.Subscript) and getattr(annotation.value, "id", None) in ("tuple", "Tuple"):
        items = annotation.slice.elts if isinstance(annotation.slice, ast.Tuple) else [annotation.slice]
        return any(_names_dict(item) for item in items)
    return False


@dataclass(frozen=True)
class Found:
    path: str
    line: int
    name: str

    def __str__(self) -> str:
        return f"{self.path}:{self.line} {self.name}"


DICT_KINDS = ("Keyed", "JsonObject", "StateDict")  # ops.records: the dicts that are what they are


def _named_kind(annotation: ast.expr) -> str | None:
    """The kind (`DICT_KINDS`) a return annotation names, itself or in a tuple."""
    if isinstance(annotation, ast.Constant) and isinstance(annotation.value, str):
        try:
            annotation = ast.parse(annotation.value, mode="eval").body
        except SyntaxError:
            return None
    items = [annotation]
    if isinstance(annotation, ast.Subscript) and getattr(annotation.value, "id", None) in ("tuple", "Tuple"):
        items = annotation.slice.elts if isinstance(annotation.slice, ast.Tuple) else [annotation.slice]
    for item in items:
        name = item.value if isinstance(item, ast.Subscript) else item
        if getattr(name, "id", None) in DICT_KINDS:
            return name.id
    return None


def dict_kinds(files: dict[str, str]) -> dict[str, list[Found]]:
    """Functions returning a dict that is what it is, by kind (`ops.records.Keyed`, `JsonObject`,
    `StateDict`): named where they are defined, so a reader (and this count) tells them from records."""
    found: dict[str, list[Found]] = {kind: [] for kind in DICT_KINDS}
    for path, source in sorted(files.items()):
        for node in ast.walk(ast.parse(source)):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) and node.returns is not None:
                kind = _named_kind(node.returns)
                if kind is not None:
                    found[kind].append(Found(path, node.lineno, node.name))
    return found


def dict_returns(files: dict[str, str]) -> list[Found]:
    """Functions annotated to return a bare dict, or a tuple holding one: a record whose shape
    only its readers know (issue 32 counted them)."""
    return [Found(path, node.lineno, node.name) for path, source in sorted(files.items())
            for node in ast.walk(ast.parse(source))
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) and node.returns is not None
            and _returns_dict(node.returns)]


def silent_broad_handlers(files: dict[str, str]) -> list[Found]:
    """`except Exception:` (or a bare `except:`) that neither names the exception nor says, in a
    comment on its line, why anything may be caught there."""
    found = []
    for path, source in sorted(files.items()):
        lines = source.splitlines()
        for node in ast.walk(ast.parse(source)):
            if not isinstance(node, ast.ExceptHandler) or node.name is not None:
                continue
            broad = node.type is None or getattr(node.type, "id", None) in ("Exception", "BaseException")
            if broad and "#" not in lines[node.lineno - 1]:
                found.append(Found(path, node.lineno, lines[node.lineno - 1].strip()))
    return found


def runs_up(imp: Import) -> bool:
    """Whether an import runs up the layers, or across to another package of its own layer (the
    ground's single modules may lean on each other)."""
    if part_of(imp.target) == part_of(imp.module):
        return False
    target, importer = layer_of(imp.target), layer_of(imp.module)
    return target > importer or (target == importer and target > 0)


def upward_imports(files: dict[str, str]) -> list[Import]:
    """The imports that run up the layers, of {path relative to the repository: source}."""
    return [imp for path, source in sorted(files.items()) for imp in imports_of(path, source) if runs_up(imp)]


# ---------------------------------------------------------------- flags

FLAG = re.compile(r"(?<![\w-])--[a-z][a-z0-9]*(?:-[a-z0-9]+)*")
WARNINGS = {"notice", "notice_once", "warn", "warning"}  # calls that warn: the library's and Python's


@dataclass(frozen=True)
class FlagMention:
    path: str
    line: int
    flags: tuple[str, ...]

    def __str__(self) -> str:
        return f"{self.path}:{self.line} names {', '.join(self.flags)}"


def _docstrings(tree: ast.AST) -> set[int]:
    kinds = (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)
    return {id(node.body[0].value) for node in ast.walk(tree)
            if isinstance(node, kinds) and node.body and isinstance(node.body[0], ast.Expr)
            and isinstance(node.body[0].value, ast.Constant)}


# A whole `pairclean` command line shown to a reader (a string that is one, or one set as code:
# the audit page's next step) is an example of the command line, not the library addressing its
# caller: its flags are not counted.
COMMAND_LINE = re.compile(r"(?:^|(?<=<code>)|(?<=`))pairclean [a-z][a-z-]*[^<`\n]*")


def _texts(tree: ast.AST, skip: set[int]) -> list[tuple[int, str]]:
    """(line, text) of every string of the code, docstrings aside; an f-string as one text with
    `{}` for its values (its parts are not read again on their own)."""
    parts = {id(value) for node in ast.walk(tree) if isinstance(node, ast.JoinedStr) for value in node.values}
    texts = []
    for node in ast.walk(tree):
        if isinstance(node, ast.JoinedStr):
            texts.append((node.lineno, "".join(v.value if isinstance(v, ast.Constant) else "{}" for v in node.values)))
        elif isinstance(node, ast.Constant) and isinstance(node.value, str) and id(node) not in skip | parts:
            texts.append((node.lineno, node.value))
    return texts


def _flags(node: ast.AST, skip: set[int] = frozenset()) -> tuple[str, ...]:
    return tuple(sorted({flag for _, text in _texts(node, skip) for flag in FLAG.findall(COMMAND_LINE.sub("", text))}))


def flag_messages(files: dict[str, str]) -> list[FlagMention]:
    """Raised errors and warnings whose text names a command-line flag (`raise X("... --out ...")`,
    `notice("... --decode ...")`): one per statement."""
    found = []
    for path, source in sorted(files.items()):
        for node in ast.walk(ast.parse(source)):
            if isinstance(node, ast.Raise) and node.exc is not None:
                said = node.exc
            elif isinstance(node, ast.Call) and (getattr(node.func, "attr", None) or getattr(node.func, "id", None)) \
                    in WARNINGS:
                said = node
            else:
                continue
            if flags := _flags(said):
                found.append(FlagMention(path, node.lineno, flags))
    return found


def _declarations(tree: ast.AST) -> set[int]:
    """Strings inside a `Shortcut(...)` call: a training method declaring the command-line flags
    that select it and their help (issue 23: the method owns its shortcuts, the CLI reads them),
    which is the one place the library may spell a flag."""
    return {id(value) for node in ast.walk(tree)
            if isinstance(node, ast.Call) and getattr(node.func, "id", None) == "Shortcut"
            for value in ast.walk(node) if isinstance(value, ast.Constant)}


def flag_strings(files: dict[str, str]) -> list[FlagMention]:
    """Every string in the code, docstrings and shortcut declarations aside, that names a
    command-line flag: messages, and what reaches them (`option="--out"` defaults, constants, text
    of a written report)."""
    found = []
    for path, source in sorted(files.items()):
        tree = ast.parse(source)
        for line, text in _texts(tree, _docstrings(tree) | _declarations(tree)):
            if flags := tuple(sorted(set(FLAG.findall(COMMAND_LINE.sub("", text))))):
                found.append(FlagMention(path, line, flags))
    return found


def library(files: dict[str, str], leave_out: tuple[str, ...] = ()) -> dict[str, str]:
    """The files of the library proper: all but the command line (which words fields as flags) and
    the folders in `leave_out`."""
    out = ("pairclean/cli/", "pairclean/__main__.py", *leave_out)
    return {path: source for path, source in files.items() if not path.startswith(out)}
