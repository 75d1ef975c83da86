"""The package's import graph, folder by folder: every import (function-level ones included) points down
the order FOLDERS states (docs/development.md gives the same), so no two folders import each other, no
module imports itself back through others, and a reader can start at the bottom and never climb back."""

from __future__ import annotations

import ast
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[1] / "finetune"

# Bottom to top: a folder imports only from the rows below its own, never from its own row's others.
# The top-level modules (the package's own __init__, errors.py, library_logs.py, __main__.py) count
# as folders of one module.
FOLDERS = [
    ("finetune", "errors", "library_logs"),  # the version, every error class, where libraries' logs go
    ("models",),  # what --model is: catalog, families, source, GGUF import
    ("config",),  # what the user asks for: options, names, switches, DeepSpeed JSON, resolve → ResolvedRun
    ("data", "checkpoint", "plan"),  # rows to train on; checkpoints on disk; the planner
    ("train",),  # the model loaded, setup, the loop, dry run, simulation
    ("launch", "export"),  # rehearse, slurm, ray, scaling, doctor; safetensors, GGUF, model card, hub
    ("cli",),  # the command line: the subcommand table, `finetune prepare`, `finetune plan` and its page
    ("__main__",),  # `python -m finetune`
]
# folders that must answer without torch: they may import these libraries only inside functions
TORCH_FREE = ("finetune/models", "finetune/config", "finetune/plan")
HEAVY = ("torch", "accelerate", "transformers", "peft", "datasets", "bitsandbytes", "deepspeed")


def module_name(path: Path) -> str:
    parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def modules() -> dict[str, Path]:
    return {module_name(p): p for p in PACKAGE.rglob("*.py")}


def imported(name: str, path: Path, known: dict[str, Path]) -> set[str]:
    """Every finetune module `name` imports, anywhere in its body (module level, functions, TYPE_CHECKING)."""
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom):
            if node.level:
                base = name.split(".") if path.name == "__init__.py" else name.split(".")[:-1]
                base = base[: len(base) - node.level + 1]
                target = ".".join(base + ([node.module] if node.module else []))
            else:
                target = node.module or ""
            for alias in node.names:
                candidate = f"{target}.{alias.name}"
                found.add(candidate if candidate in known else target)
        elif isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
    return {m for m in found if m in known and m != name}


def folder(name: str) -> str:
    """finetune.train.loop → train; finetune.errors → errors; finetune → finetune."""
    parts = name.split(".")
    return parts[1] if len(parts) > 1 else parts[0]


def row(folder_name: str) -> int:
    found = [index for index, names in enumerate(FOLDERS) if folder_name in names]
    assert found, f"{folder_name} is in no row of FOLDERS: add it where its imports put it"
    return found[0]


def folder_imports(known: dict[str, Path]) -> dict[tuple[str, str], list[str]]:
    """(importing folder, imported folder) → the module imports that make the edge."""
    edges: dict[tuple[str, str], list[str]] = {}
    for name, path in known.items():
        for target in sorted(imported(name, path, known)):
            if folder(name) != folder(target):
                edges.setdefault((folder(name), folder(target)), []).append(f"{name} imports {target}")
    return edges


def test_every_folder_has_a_row():
    for name in modules():
        row(folder(name))


def test_no_two_folders_import_each_other():
    edges = folder_imports(modules())
    both_ways = [f"{a} ↔ {b}: " + "; ".join(edges[a, b] + edges[b, a]) for a, b in edges if (b, a) in edges and a < b]
    assert not both_ways, "\n".join(both_ways)


def test_imports_point_down_the_folder_order():
    upward = [f"{a} (row {row(a)}) → {b} (row {row(b)}): " + "; ".join(found)
              for (a, b), found in folder_imports(modules()).items() if row(b) >= row(a)]
    assert not upward, "\n".join(upward)


def test_the_development_page_states_this_order():
    """docs/development.md's `a` → `b/`, `c/` → … line is FOLDERS, bottom first (the package's own
    __init__ aside), so the page a contributor reads is the rule this test enforces."""
    import re

    page = (PACKAGE.parent / "docs" / "development.md").read_text()
    line = re.search(r"`errors`[^.]*`__main__`", page, re.S).group()
    stated = [tuple(re.findall(r"`(\w+)/?`", part)) for part in line.split("→")]
    assert stated == [tuple(name for name in names if name != "finetune") for names in FOLDERS]


def test_no_import_cycle():
    known = modules()
    graph = {name: imported(name, path, known) for name, path in known.items()}
    cycles, done = [], set()

    def visit(name: str, stack: list[str]) -> None:
        if name in stack:
            cycles.append(" → ".join(stack[stack.index(name):] + [name]))
            return
        if name in done:
            return
        for target in sorted(graph[name]):
            visit(target, stack + [name])
        done.add(name)

    for name in sorted(graph):
        visit(name, [])
    assert not cycles, "\n".join(cycles)


def test_torch_free_folders_import_no_heavy_library_at_module_level():
    offenders = []
    for torch_free in TORCH_FREE:
        for path in (PACKAGE.parent / torch_free).rglob("*.py"):
            for node in ast.parse(path.read_text()).body:  # module level only: functions may import lazily
                names = [a.name for a in node.names] if isinstance(node, ast.Import) else \
                        [node.module or ""] if isinstance(node, ast.ImportFrom) and not node.level else []
                offenders += [f"{path.relative_to(PACKAGE.parent)}: {n}" for n in names if n.split(".")[0] in HEAVY]
    assert not offenders, "\n".join(offenders)


def test_the_layer_test_sees_an_upward_import_and_a_pair(tmp_path):
    """The checks themselves can fail: a config module importing the trainer is an upward edge, and with
    the trainer importing config back, a pair of folders that import each other."""
    known = {"finetune.config.options": tmp_path / "options.py", "finetune.train.run": tmp_path / "run.py"}
    known["finetune.config.options"].write_text("def f():\n    from finetune.train import run\n")
    known["finetune.train.run"].write_text("from finetune.config.options import f\n")
    assert imported("finetune.config.options", known["finetune.config.options"], known) == {"finetune.train.run"}
    edges = folder_imports(known)
    assert set(edges) == {("config", "train"), ("train", "config")}
    assert row("train") > row("config")
