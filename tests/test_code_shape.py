"""The library keeps the shape docs/architecture.md describes: short functions, imports that go one way."""
import ast
import importlib.util
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
_spec = importlib.util.spec_from_file_location("code_shape", ROOT / "benchmarks" / "code_shape.py")
code_shape = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(code_shape)


def test_no_function_in_the_library_is_longer_than_a_screen():
    long = [(name, length) for name, length, _ in code_shape.functions() if length > code_shape.MAX_FUNCTION_LINES]
    assert not long, f"functions over {code_shape.MAX_FUNCTION_LINES} lines (split them by idea): {long}"


def test_no_import_cycle_counting_imports_inside_functions():
    assert code_shape.import_cycles() == []


def test_the_measure_sees_cycles_and_long_functions(tmp_path, monkeypatch):
    """The two checks above can fail: a made-up package with a lazy-import cycle and a long function."""
    package = tmp_path / "colossal_lite"
    package.mkdir()
    (package / "__init__.py").write_text("")
    (package / "a.py").write_text("from . import b\n")
    body = "\n".join(f"    x{i} = {i}" for i in range(70))
    (package / "b.py").write_text(f"def f():\n    from .a import g\n{body}\n")
    monkeypatch.setattr(code_shape, "ROOT", tmp_path)
    assert code_shape.import_cycles() == [["colossal_lite.a", "colossal_lite.b"]]
    assert [(name, length) for name, length, _ in code_shape.functions()] == [("colossal_lite.b:f", 72)]


def test_no_module_of_the_package_is_imported_inside_a_function():
    lazy = []
    for path in code_shape.library_files():
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                for inner in ast.walk(node):
                    own = isinstance(inner, ast.ImportFrom) and (inner.level or (inner.module or "").startswith(
                        "colossal_lite")) or isinstance(inner, ast.Import) and any(
                        a.name.startswith("colossal_lite") for a in inner.names)
                    if own:
                        lazy.append(f"{path.relative_to(ROOT)}:{inner.lineno}")
    assert not lazy, f"imports of the package's own modules inside functions (move them to the top): {lazy}"
