"""Every module imports first in a fresh state, and all of them together, without circular-import errors; the import
graph has no cycle, so no other order can fail; no architecture file imports train.py (architectures are models;
training, measuring and serving import them, never the reverse)."""
import ast
import itertools
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
# the root files by their plain names, the harness package's as harness.X
MODULES = sorted([p.stem for p in ROOT.glob("*.py")]
                 + [f"harness.{p.stem}" for p in ROOT.glob("harness/[!_]*.py")])
ARCH_FILES = ["model", "recursive", "svd_lora", "block_transformer", "plt", "double_decoder", "kernels", "harness.hf"]


def module_path(m: str) -> Path:
    return ROOT / f"{m.replace('.', '/')}.py"


def is_main_guard(node) -> bool:
    """`if __name__ == "__main__":`, the block a file runs as a command and never when it is imported."""
    return isinstance(node, ast.If) and isinstance(node.test, ast.Compare) and \
        getattr(node.test.left, "id", None) == "__name__" and \
        getattr(node.test.comparators[0], "value", None) == "__main__"


def imported_modules(path: Path) -> set[str]:
    """Module names a file imports anywhere it can be reached from an import of it (module level or inside functions,
    not a main-guard block: `python serve.py` runs harness/serve_demo.py as a module (runpy), which imports serve.py;
    importing serve.py imports no demo): top-level names, and harness.X for a module of the harness package
    (`from harness import X`, `from harness.X import ...`)."""
    names = set()
    tree = ast.parse(path.read_text())
    tree.body = [node for node in tree.body if not is_main_guard(node)]
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names |= {".".join(a.name.split(".")[:2 if a.name.startswith("harness.") else 1]) for a in node.names}
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            if node.module == "harness":
                names |= {f"harness.{a.name}" for a in node.names}
            else:
                names.add(".".join(node.module.split(".")[:2 if node.module.startswith("harness.") else 1]))
    return names


@pytest.mark.slow
def test_each_module_imports_first_and_all_import_together():
    """In one fresh interpreter: each module imported first, with no module of this repository loaded (a circular
    import fails only when the cycle is entered at a module not yet loaded, and the import graph below has no cycle,
    static imports and those inside functions alike), then all of them in sorted order."""
    script = ["import importlib, sys", f"sys.path.insert(0, {str(ROOT)!r})",
              f"mods = {MODULES!r}", "orders = [[m] for m in mods] + [mods]",
              "for order in orders:",
              "    for m in list(sys.modules):",
              "        if m in mods: del sys.modules[m]",
              "    for m in order: importlib.import_module(m)",
              "print('ok', len(orders))"]
    res = subprocess.run([sys.executable, "-c", "\n".join(script)], capture_output=True, text=True, timeout=300)
    assert res.returncode == 0, res.stderr[-2000:]
    assert res.stdout.split() == ["ok", str(len(MODULES) + 1)]


def import_graph() -> dict[str, set[str]]:
    """module -> the modules of this repository it imports."""
    return {m: imported_modules(module_path(m)) & set(MODULES) - {m} for m in MODULES}


def reachable(graph, src) -> set[str]:
    """Every module src imports, directly or through the modules it imports."""
    seen, todo = set(), [src]
    while todo:
        for n in graph[todo.pop()] - seen:
            seen.add(n)
            todo.append(n)
    return seen


def test_import_graph_has_no_cycle_and_models_do_not_import_train():
    graph = import_graph()
    for m in ARCH_FILES:
        assert not graph[m] & {"train", "serve", "bench"}, f"{m}.py imports {graph[m] & {'train', 'serve', 'bench'}}"
    for a, b in itertools.permutations(MODULES, 2):  # a cycle of length 2 or more shows up as mutual reachability
        assert not (b in reachable(graph, a) and a in reachable(graph, b)), f"import cycle through {a} and {b}"


def test_model_and_kernels_import_no_project_module():
    """model.py and kernels.py are the ground floor: they import no module of this repository. The CPU forms chosen by
    measurement (cpu_tuning.py) reach them through their hooks (model.tuned_ops, kernels.cpu_lora_form), never the
    reverse."""
    graph = import_graph()
    assert graph["model"] == set() and graph["kernels"] == set(), (graph["model"], graph["kernels"])


def test_library_modules_do_not_import_the_scripts():
    """data.py (tokenizer, corpus, batches), checkpoint.py (checkpoint files, model sources) and cli.py (the error
    contract) are what the scripts share: none of them reaches train.py, serve.py or bench.py, not even through
    another module, so a script can use them without loading another script."""
    graph = import_graph()
    for m in ["harness.data", "harness.checkpoint", "harness.cli"]:
        assert not reachable(graph, m) & {"train", "serve", "bench"}, \
            f"{m}.py reaches {reachable(graph, m) & {'train', 'serve', 'bench'}}"


def test_one_cache_constructor_and_one_overflow_error():
    """Every architecture builds its cache through GPT.new_cache (it names cache_cls and, if needed, cache_kwargs), and
    every cache reports an overflow through KVCache.fits: `def new_cache` and the overflow message are written once,
    in model.py, across the repository's modules."""
    sources = {m: module_path(m).read_text() for m in MODULES}
    for needle in ("def new_cache(", "KV cache holds"):
        where = {m: s.count(needle) for m, s in sources.items() if needle in s}
        assert where == {"model": 1}, f"{needle!r} written in {where}"
