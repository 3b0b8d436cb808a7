"""Lines of Python per package, import loops, imports that run up the layers, and library messages
naming a command-line flag (docs/architecture.md, issues 14 and 23).

    python benchmarks/architecture_stats.py              # the work tree
    python benchmarks/architecture_stats.py b830b06      # + a revision, its flat modules counted where they live now
    python benchmarks/architecture_stats.py --list 6179287   # + every upward import and flag mention, listed

Import loops are strongly connected components of the module graph, counting every import
statement, including the deferred ones inside functions (a loop hidden in a function is still a loop).
The layers and both checks are tests/conventions.py (of the work tree, applied to each revision).
"""

from __future__ import annotations

import ast
import subprocess
import sys
from collections import Counter
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))
from conventions import flag_messages, flag_strings, library, upward_imports  # noqa: E402

# Where each module of the flat layout (before issue 14) lives now.
FLAT_TO_PACKAGE = {
    "sources": "data", "manifest": "data", "decode": "data", "packing": "data", "estimators": "backends",
    "st_estimator": "backends", "accel": "backends", "scorer": "core", "beta": "core", "gmm": "core",
    "pipeline": "scoring", "embeddings": "scoring", "sink": "scoring", "finalize": "scoring", "metrics": "scores",
    "query": "curate", "filter": "curate", "report": "curate", "corrupt": "lab", "coco_text": "lab", "coco": "lab",
    "toy_pairs": "lab", "demo": "lab", "bench": "ops", "distributed": "ops", "faults": "ops", "atomic": "ops",
    "retrieval": "train", "errors": "(top level)", "__init__": "(top level)", "__main__": "(top level)"}


def _lines(text: str) -> int:
    return sum(1 for line in text.splitlines() if line.strip())


def package_of(relative: tuple[str, ...]) -> str:
    if len(relative) == 1:
        return FLAT_TO_PACKAGE.get(relative[0][:-3], "(top level)")
    if relative[0] == "synth":
        return "lab"
    if relative == ("train", "models.py"):
        return "backends"
    return relative[0]


def files_at(rev: str | None) -> dict[str, str]:
    if rev is None:
        return {str(p): p.read_text() for p in Path("pairclean").rglob("*.py")}
    names = subprocess.run(["git", "ls-tree", "-r", "--name-only", rev, "pairclean"], capture_output=True,
                           text=True, check=True).stdout.split()
    return {n: subprocess.run(["git", "show", f"{rev}:{n}"], capture_output=True, text=True, check=True).stdout
            for n in names if n.endswith(".py")}


def lines_per_package(files: dict[str, str]) -> Counter:
    counts = Counter()
    for name, text in files.items():
        counts[package_of(Path(name).relative_to("pairclean").parts)] += _lines(text)
    return counts


def import_loops(files: dict[str, str]) -> list[list[str]]:
    modules = {}
    for name in files:
        dotted = ".".join(Path(name).with_suffix("").parts)
        modules[dotted.removesuffix(".__init__")] = name
    graph: dict[str, set[str]] = {m: set() for m in modules}
    for module, name in modules.items():
        for node in ast.walk(ast.parse(files[name])):
            if isinstance(node, ast.Import):
                targets = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom) and node.module and not node.level:
                targets = [node.module] + [f"{node.module}.{a.name}" for a in node.names]
            else:
                continue
            graph[module].update(t for t in targets if t in graph and t != module)
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    loops: list[list[str]] = []

    def visit(v: str) -> None:  # Tarjan's strongly connected components
        index[v] = low[v] = len(index)
        stack.append(v)
        for w in graph[v]:
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                loops.append(sorted(component))

    sys.setrecursionlimit(10_000)
    for v in graph:
        if v not in index:
            visit(v)
    return loops


def main() -> None:
    listing = "--list" in sys.argv
    revisions = [None] + [arg for arg in sys.argv[1:] if arg != "--list"]
    counts = {rev: lines_per_package(files_at(rev)) for rev in revisions}
    names = sorted(set().union(*counts.values()))
    header = ["package"] + [rev or "work tree" for rev in revisions]
    print("| " + " | ".join(header) + " |\n|" + "---|" * len(header))
    for name in names + ["total"]:
        row = [str(sum(counts[r].values()) if name == "total" else counts[r].get(name, 0)) for r in revisions]
        print(f"| {name} | " + " | ".join(row) + " |")
    for rev in revisions:
        files = files_at(rev)
        name = rev or "work tree"
        print(f"import loops ({name}): {import_loops(files) or 'none'}")
        checks = {"imports that run up the layers": upward_imports(files),
                  "raised errors and warnings naming a flag (outside cli/)": flag_messages(library(files)),
                  "strings naming a flag (outside cli/, docstrings aside)": flag_strings(library(files)),
                  "  of which outside train/": flag_strings(library(files, ("pairclean/train/",)))}
        for label, found in checks.items():
            print(f"{label} ({name}): {len(found)}")
            if listing:
                print("".join(f"    {item}\n" for item in found), end="")


if __name__ == "__main__":
    main()
