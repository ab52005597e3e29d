"""Finds the scripts that the tests run on several ranks, and their prints that are not one write of a line.

The ranks of a torchrun job share one stdout pipe (and one stderr pipe). ``print(text)`` writes ``text`` and then
the newline: two writes, so another rank's line can land between them (``step 5finished at step 9`` and then two
newlines) and a test that reads lines fails now and then. ``print(text + "\\n", end="")`` or
``sys.stdout.write(text + "\\n")`` is one write, and another process's write to the pipe never lands inside it.

A module-level string that a function starting torchrun refers to (itself or through a helper of the same module)
is such a script, and so is a string literal of several lines inside that function, and a module function handed
to ``spawn``. Only the source is read; no process is started.
"""
import ast
import textwrap

MARKERS = ("run_torchrun", "run_ranks", "torch.distributed.run")  # how the tests start several ranks
STREAMS = ("sys.stdout", "sys.stderr")


def _string_value(node, strings):
    """The text of a string expression made of literals, names of module strings, ``textwrap.dedent`` and ``+``."""
    if isinstance(node, ast.Constant) and isinstance(node.value, str):
        return node.value
    if isinstance(node, ast.Name):
        return strings.get(node.id)
    if isinstance(node, ast.Call) and ast.unparse(node.func) in ("textwrap.dedent", "dedent") and len(node.args) == 1:
        inner = _string_value(node.args[0], strings)
        return None if inner is None else textwrap.dedent(inner)
    if isinstance(node, ast.BinOp) and isinstance(node.op, ast.Add):
        left, right = _string_value(node.left, strings), _string_value(node.right, strings)
        return None if left is None or right is None else left + right
    return None


def _module_strings(tree):
    strings = {}
    for node in tree.body:
        if isinstance(node, ast.Assign) and len(node.targets) == 1 and isinstance(node.targets[0], ast.Name):
            value = _string_value(node.value, strings)
            if value is not None:
                strings[node.targets[0].id] = value
    return strings


def _parsed(text):
    """The script's syntax tree, or None for a string that is not Python (a config line, an expected message)."""
    try:
        return ast.parse(text)
    except SyntaxError:
        return None


def _spawned(call, functions):
    """The module function that ``spawn(func, ...)`` or ``spawn(partial(func, ...), ...)`` runs, if any."""
    if ast.unparse(call.func).split(".")[-1] != "spawn" or not call.args:
        return None
    target = call.args[0]
    if isinstance(target, ast.Call) and ast.unparse(target.func).split(".")[-1] == "partial" and target.args:
        target = target.args[0]
    return functions.get(target.id) if isinstance(target, ast.Name) else None


def multi_rank_scripts(path):
    """``{name: syntax tree}`` of the scripts and functions that the test module ``path`` runs on several ranks."""
    source = path.read_text(encoding="utf-8")
    tree = ast.parse(source)
    strings = _module_strings(tree)
    functions = {n.name: n for n in tree.body if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef))}
    starters = {name for name, f in functions.items() if any(m in ast.get_source_segment(source, f) for m in MARKERS)}
    found = {}
    for name, func in functions.items():
        calls = [n for n in ast.walk(func) if isinstance(n, ast.Call)]
        if name in starters or any(ast.unparse(c.func) in starters for c in calls):
            for node in ast.walk(func):
                if isinstance(node, ast.Name) and node.id in strings:
                    found[node.id] = _parsed(strings[node.id])
                elif isinstance(node, ast.Constant) and isinstance(node.value, str) and "\n" in node.value.strip():
                    found[f"{name}:{node.lineno}"] = _parsed(textwrap.dedent(node.value))
        for call in calls:
            target = _spawned(call, functions)
            if target is not None:
                found[target.name] = target
    return {name: script for name, script in found.items() if script is not None}


def _ends_with_newline(node):
    if isinstance(node, ast.Constant):
        return isinstance(node.value, str) and node.value.endswith("\n")
    if isinstance(node, ast.JoinedStr):
        return bool(node.values) and _ends_with_newline(node.values[-1])
    if isinstance(node, ast.BinOp) and isinstance(node.op, ast.Add):
        return _ends_with_newline(node.right)
    return False


def two_write_prints(script):
    """``'line: call'`` of each print or stream write in ``script`` that may put a line into the pipe in two writes."""
    found = []
    for node in ast.walk(script):
        if not isinstance(node, ast.Call):
            continue
        name, keywords = ast.unparse(node.func), {k.arg: k.value for k in node.keywords}
        if name == "print":
            target, end = keywords.get("file"), keywords.get("end")
            if target is not None and ast.unparse(target) not in STREAMS:
                continue  # a file of its own, not the shared pipe
            one_write = (len(node.args) == 1 and _ends_with_newline(node.args[0])
                         and isinstance(end, ast.Constant) and end.value == "")
        elif name in [f"{stream}.write" for stream in STREAMS]:
            one_write = len(node.args) == 1 and _ends_with_newline(node.args[0])
        else:
            continue
        if not one_write:
            found.append(f"{node.lineno}: {ast.unparse(node)}")
    return found

