"""The package's import graph: no cycle (function-level imports included) and every import points down
the layer order docs/development.md gives, so a reader can start at the bottom and never climb back."""

from __future__ import annotations

import ast
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[1] / "finetune"

# Bottom to top. A module's layer is that of the longest prefix listed; `*.command` modules (the CLI's
# subcommands) sit with the CLI and may import from any folder.
LAYERS = [
    ("finetune", "finetune.errors", "finetune.library_logs"),
    ("finetune.config.names", "finetune.models.families", "finetune.models.catalog", "finetune.models.gguf_import",
     "finetune.models.source", "finetune.plan.gpus"),
    ("finetune.config",),
    ("finetune.models", "finetune.data", "finetune.checkpoint", "finetune.plan"),
    ("finetune.train",),
    ("finetune.launch", "finetune.export"),
    ("finetune.cli", "finetune.__main__"),
]
TOP = len(LAYERS) - 1
# folders that must answer without torch: they may import these libraries only inside functions
TORCH_FREE = ("finetune/config", "finetune/plan")
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


def layer(name: str) -> int:
    if name.endswith(".command"):
        return TOP
    best, rank = -1, -1
    for index, prefixes in enumerate(LAYERS):
        for prefix in prefixes:
            if (name == prefix or name.startswith(prefix + ".")) and len(prefix) > best:
                best, rank = len(prefix), index
    assert rank >= 0, f"{name} is in no layer: add its folder to LAYERS"
    return rank


def test_imports_point_down_the_layers():
    known = modules()
    upward = [f"{name} (layer {layer(name)}) imports {target} (layer {layer(target)})"
              for name, path in known.items() for target in sorted(imported(name, path, known)) if layer(target) > layer(name)]
    assert not upward, "\n".join(upward)


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
    for folder in TORCH_FREE:
        for path in (PACKAGE.parent / folder).rglob("*.py"):
            for node in ast.parse(path.read_text()).body:  # module level only: functions may import lazily
                names = [a.name for a in node.names] if isinstance(node, ast.Import) else \
                        [node.module or ""] if isinstance(node, ast.ImportFrom) and not node.level else []
                offenders += [f"{path.relative_to(PACKAGE.parent)}: {n}" for n in names if n.split(".")[0] in HEAVY]
    assert not offenders, "\n".join(offenders)


def test_the_layer_test_sees_an_upward_import(tmp_path):
    """The check itself can fail: a config module importing the trainer is reported."""
    known = {"finetune.config.options": tmp_path / "options.py", "finetune.train.run": tmp_path / "run.py"}
    known["finetune.config.options"].write_text("def f():\n    from finetune.train import run\n")
    assert imported("finetune.config.options", known["finetune.config.options"], known) == {"finetune.train.run"}
    assert layer("finetune.train.run") > layer("finetune.config.options")
