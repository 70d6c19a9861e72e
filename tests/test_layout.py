"""Where things live: the scripts that serve, measure and evaluate models reach no train.py, not even
through another module (data, checkpoints and the error path are data.py, checkpoint.py and cli.py), and eval.py's
docstring names the commands it runs."""
import ast

from test_imports import ROOT, import_graph, reachable

import eval


def test_serve_bench_hf_and_eval_reach_no_train():
    graph = import_graph()
    for m in ["serve", "bench", "harness.bench_serve", "harness.hf", "eval"]:
        assert "train" not in reachable(graph, m), f"{m}.py reaches train.py"


def test_eval_docstring_names_each_command():
    """Every subcommand of eval.py's parser stands in its docstring as a runnable line `python eval.py <command>`."""
    sub = next(a for a in eval.build_parser()._actions if a.dest == "what")
    assert set(sub.choices) == {"loss", "exits", "energy", "double-eval", "block", "recovery", "samples", "sweep"}
    doc = ast.get_docstring(ast.parse((ROOT / "eval.py").read_text()))
    for command in sub.choices:
        assert f"python eval.py {command} " in doc, command
