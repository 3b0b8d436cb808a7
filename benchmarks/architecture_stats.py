"""Lines of Python per package, import loops, imports that run up the layers, and library messages
naming a command-line flag (docs/architecture.md, issues 14 and 23).

    python benchmarks/architecture_stats.py              # the work tree
    python benchmarks/architecture_stats.py b830b06      # + a revision, its flat modules counted where they live now
    python benchmarks/architecture_stats.py --list 6179287   # + every upward import and flag mention, listed

Import cycles are strongly connected components of the module graph, counting every import
statement, including the deferred ones inside functions (a cycle hidden in a function is still a
cycle; `conventions.import_cycles`, which tests/test_layers.py holds to none).
The layers and both checks are tests/conventions.py (of the work tree, applied to each revision).
"""

from __future__ import annotations

import ast
import subprocess
import sys
from collections import Counter
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))
from conventions import (dict_kinds, dict_returns, flag_messages, flag_strings, import_cycles, imports_of, library,  # noqa: E402
                         part_of, silent_broad_handlers, upward_imports)

# Where each module of the flat layout (before issue 14) lives now.
FLAT_TO_PACKAGE = {
    "sources": "data", "manifest": "data", "decode": "data", "packing": "data", "estimators": "backends",
    "st_estimator": "backends", "accel": "backends", "scorer": "core", "beta": "core", "gmm": "core",
    "pipeline": "scoring", "embeddings": "scoring", "sink": "scoring", "finalize": "scoring", "metrics": "scorefile",
    "query": "curate", "filter": "curate", "report": "curate", "corrupt": "lab", "coco_text": "lab", "coco": "lab",
    "toy_pairs": "lab", "demo": "lab", "bench": "ops", "distributed": "ops", "faults": "ops", "atomic": "ops",
    "retrieval": "training", "errors": "(top level)", "__init__": "(top level)", "__main__": "(top level)"}


# Packages renamed since (their modules counted under the name they have now).
RENAMED = {"train": "training", "scores": "scorefile"}


def _lines(text: str) -> int:
    return sum(1 for line in text.splitlines() if line.strip())


def package_of(relative: tuple[str, ...]) -> str:
    if len(relative) == 1:
        return FLAT_TO_PACKAGE.get(relative[0][:-3], "(top level)")
    if relative[0] == "synth":
        return "lab"
    if relative == ("train", "models.py"):
        return "backends"
    return RENAMED.get(relative[0], relative[0])


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


def across(files: dict[str, str], importer: str, imported: str) -> list:
    """Import statements of the package `importer` that import from the package `imported`."""
    return [imp for path, source in sorted(files.items()) if path.startswith(f"pairclean/{importer}/")
            for imp in imports_of(path, source) if part_of(imp.target) == imported]


def partial_typed_dicts(files: dict[str, str]) -> list[str]:
    """Records declared `TypedDict(..., total=False)`: any key may be missing, readers guess."""
    def typed_dict(node) -> bool:
        names = node.bases if isinstance(node, ast.ClassDef) else [node.func] if isinstance(node, ast.Call) else []
        return any(getattr(n, "id", getattr(n, "attr", None)) == "TypedDict" for n in names)

    return [f"{path}:{node.lineno}" for path, source in sorted(files.items()) for node in ast.walk(ast.parse(source))
            if typed_dict(node) and any(k.arg == "total" and getattr(k.value, "value", None) is False
                                        for k in node.keywords)]


def batch_lookups(files: dict[str, str]) -> list[str]:
    """Batch records read by a string key in backends/ and scoring/ (`batch["jpeg_rows"]`): a dict whose shape
    a lower layer must know; a typed batch (scoring.batches.PairBatch) has attributes instead."""
    def batch_named(node: ast.expr) -> bool:
        return "batch" in getattr(node, "id", getattr(node, "attr", "")).lower()

    return [f"{path}:{node.lineno}" for path, source in sorted(files.items())
            if path.startswith(("pairclean/backends/", "pairclean/scoring/")) for node in ast.walk(ast.parse(source))
            if isinstance(node, ast.Subscript) and batch_named(node.value)
            and isinstance(getattr(node.slice, "value", None), str)]


def main() -> None:
    if {"-h", "--help"} & set(sys.argv):
        sys.exit(__doc__)
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
        print(f"import cycles, deferred imports counted ({name}): {len(import_cycles(files))}")
        if listing:
            print("".join(f"    {' <-> '.join(cycle)}\n" for cycle in import_cycles(files)), end="")
        print(f"conventions.py in pairclean/ ({name}): {'pairclean/conventions.py' in files}")
        checks = {"imports that run up the layers": upward_imports(files),
                  "raised errors and warnings naming a flag (outside cli/)": flag_messages(library(files)),
                  "strings naming a flag (outside cli/, docstrings aside)": flag_strings(library(files)),
                  "  of which outside training/": flag_strings(library(files, ("pairclean/training/",))),
                  "functions annotated to return a bare dict (or a tuple holding one)": dict_returns(files),
                  "`except Exception:` that neither names the exception nor says why": silent_broad_handlers(files),
                  "imports of scoring inside dedup": across(files, "dedup", "scoring"),
                  "TypedDict(total=False) records": partial_typed_dicts(files),
                  "string-keyed batch lookups in backends/ and scoring/": batch_lookups(files)}
        for label, found in checks.items():
            print(f"{label} ({name}): {len(found)}")
            if listing:
                print("".join(f"    {item}\n" for item in found), end="")
        kinds = dict_kinds(files)
        print(f"dict returns named by kind ({name}): " + ", ".join(f"{kind} {len(found)}" for kind, found in kinds.items()))
        if listing:
            for kind, found in kinds.items():
                print("".join(f"    {kind}: {item}\n" for item in found), end="")


if __name__ == "__main__":
    main()
