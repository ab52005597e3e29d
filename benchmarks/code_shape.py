"""The shape of the library's code: longest functions, branchiest functions, lines, import cycles.

    python benchmarks/code_shape.py [--top 10] [--json]

- length: lines from a function's ``def`` to its last line (decorators and docstring included);
- complexity: McCabe's count, 1 + one per ``if``/``for``/``while``/``except``/``with``-less branch point,
  conditional expression, comprehension ``if`` and extra boolean operand;
- lines of code: non-blank lines that are not only a comment, over ``colossal_lite/``;
- import cycles: strongly connected groups of the package's own modules, counting imports written inside
  functions too (a lazy import hides a cycle, it does not remove it); ``from . import x`` counts as an
  import of the package ``__init__`` only when ``x`` is not a submodule.

``tests/test_code_shape.py`` holds the library to no function over 60 lines and no import cycle.
"""
from __future__ import annotations

import argparse
import ast
import json
import sys
from pathlib import Path
from typing import Dict, List, Set, Tuple

ROOT = Path(__file__).resolve().parent.parent
PACKAGE = "colossal_lite"
MAX_FUNCTION_LINES = 60


def module_name(path: Path) -> str:
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts = parts[:-1]
    return ".".join(parts)


def library_files() -> List[Path]:
    return sorted((ROOT / PACKAGE).rglob("*.py"))


def _complexity(node: ast.AST) -> int:
    count = 1
    for child in ast.walk(node):
        if isinstance(child, (ast.If, ast.For, ast.AsyncFor, ast.While, ast.IfExp, ast.ExceptHandler, ast.Assert)):
            count += 1
        elif isinstance(child, ast.comprehension):
            count += 1 + len(child.ifs)
        elif isinstance(child, ast.BoolOp):
            count += len(child.values) - 1
        elif isinstance(child, getattr(ast, "match_case", ())):
            count += 1
    return count


def _visit(node: ast.AST, prefix: str, found: list) -> None:
    for child in ast.iter_child_nodes(node):
        if isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef)):
            first = min([child.lineno] + [d.lineno for d in child.decorator_list])
            found.append((f"{prefix}{child.name}", child.end_lineno - first + 1, _complexity(child)))
            _visit(child, f"{prefix}{child.name}.", found)
        elif isinstance(child, ast.ClassDef):
            _visit(child, f"{prefix}{child.name}.", found)


def functions() -> List[Tuple[str, int, int]]:
    """``(qualified name, length in lines, complexity)`` of every function and method in the library."""
    found = []
    for path in library_files():
        tree = ast.parse(path.read_text(), filename=str(path))
        mod = module_name(path)

        _visit(tree, f"{mod}:", found)
    return found


def lines_of_code() -> int:
    total = 0
    for path in library_files():
        total += sum(1 for line in path.read_text().splitlines() if line.strip() and not line.strip().startswith("#"))
    return total


def import_graph() -> Dict[str, Set[str]]:
    """Module -> the package's own modules it imports (anywhere in the file)."""
    modules = {module_name(p): p for p in library_files()}
    graph: Dict[str, Set[str]] = {m: set() for m in modules}
    for mod, path in modules.items():
        package = mod if path.name == "__init__.py" else mod.rpartition(".")[0]
        for node in ast.walk(ast.parse(path.read_text())):
            targets = []
            if isinstance(node, ast.Import):
                targets = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom):
                if node.level:
                    base = package.split(".")
                    base = base[: len(base) - (node.level - 1)]
                    origin = ".".join(base + ([node.module] if node.module else []))
                else:
                    origin = node.module or ""
                for alias in node.names:
                    sub = f"{origin}.{alias.name}"
                    targets.append(sub if sub in modules else origin)
            for target in targets:
                while target and target not in modules:
                    target = target.rpartition(".")[0]
                if target and target != mod:
                    graph[mod].add(target)
    return graph


def strongly_connected(graph: Dict[str, Set[str]]) -> List[List[str]]:
    """Groups of more than one module that import each other, directly or around a loop (Tarjan), each sorted."""
    index: Dict[str, int] = {}
    low: Dict[str, int] = {}
    stack: List[str] = []
    on_stack: Set[str] = set()
    groups: List[List[str]] = []
    counter = [0]
    sys.setrecursionlimit(10000)

    def strongconnect(v):
        index[v] = low[v] = counter[0]
        counter[0] += 1
        stack.append(v)
        on_stack.add(v)
        for w in graph[v]:
            if w not in index:
                strongconnect(w)
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

    for v in graph:
        if v not in index:
            strongconnect(v)
    return groups


def import_cycles() -> List[List[str]]:
    """Cycles among modules that are not package ``__init__`` files. An ``__init__`` re-exports its submodules,
    and they import siblings through it: Python's usual layout, resolved by import order, not a design knot."""
    graph = import_graph()
    inits = {module_name(p) for p in library_files() if p.name == "__init__.py"}
    return strongly_connected({m: {w for w in ws if w not in inits} for m, ws in graph.items() if m not in inits})


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--top", type=int, default=10)
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()
    funcs = functions()
    longest = sorted(funcs, key=lambda f: -f[1])[: args.top]
    branchiest = sorted(funcs, key=lambda f: -f[2])[: args.top]
    report = {"lines_of_code": lines_of_code(), "functions": len(funcs),
              "over_60_lines": sum(1 for f in funcs if f[1] > MAX_FUNCTION_LINES),
              "longest": longest, "most_complex": branchiest, "import_cycles": import_cycles()}
    if args.json:
        print(json.dumps(report))
        return
    print(f"lines of code: {report['lines_of_code']}, functions: {report['functions']}, "
          f"over {MAX_FUNCTION_LINES} lines: {report['over_60_lines']}")
    print("longest:")
    for name, length, cx in longest:
        print(f"  {length:4d} lines  complexity {cx:3d}  {name}")
    print("most complex:")
    for name, length, cx in branchiest:
        print(f"  complexity {cx:3d}  {length:4d} lines  {name}")
    print("import cycles:", report["import_cycles"] or "none")


if __name__ == "__main__":
    main()
