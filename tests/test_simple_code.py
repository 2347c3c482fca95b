"""The generated simple modules (dist_glm5/train/simple_code.py), checked by Python's own parser."""

import ast
import builtins
import random

import pytest

from dist_glm5.train import corpus, simple_code
from dist_glm5.train import trainer as td


def unbound_names(fn: ast.FunctionDef, tree: ast.Module) -> set[str]:
    """Names fn reads that nothing binds: not a parameter, a local (assigned, a loop's or a
    with's target, a lambda's or a comprehension's variable), a module-level def or import, or a
    builtin. A generated function that reads an unbound name is not code anyone writes."""
    bound = set(dir(builtins))
    for node in tree.body:
        if isinstance(node, (ast.FunctionDef, ast.ClassDef)):
            bound.add(node.name)
        elif isinstance(node, ast.Import):
            bound |= {a.name for a in node.names}
    for node in ast.walk(fn):
        if isinstance(node, ast.arg):
            bound.add(node.arg)
        elif isinstance(node, ast.Name) and isinstance(node.ctx, ast.Store):
            bound.add(node.id)
    loads = {n.id for n in ast.walk(fn) if isinstance(n, ast.Name) and isinstance(n.ctx, ast.Load)}
    return loads - bound


def test_every_module_is_python_with_a_docstring_in_every_function():
    kinds = set()
    for seed in range(300):
        text = simple_code.module(random.Random(seed), 2500, cut=False).decode()
        tree = ast.parse(text)  # raises on anything that is not Python
        funcs = [n for n in ast.walk(tree) if isinstance(n, ast.FunctionDef)]
        assert funcs
        for fn in funcs:
            assert fn.name in ("__init__", "__repr__") or ast.get_docstring(fn), fn.name
            kinds.add(fn.body[-1].__class__.__name__)
            assert not unbound_names(fn, tree), (fn.name, unbound_names(fn, tree))
        assert "os.walk" not in text  # the code gate's snippet's loop is not taught
    assert {"Return", "Try", "Assign"} <= kinds  # returns, a try, __init__'s assignments


def test_a_module_is_cut_at_its_size_and_indented_as_the_reindented_corpus():
    for seed in range(50):
        whole = simple_code.module(random.Random(seed), 1800, cut=False)
        cut = simple_code.module(random.Random(seed), 1800)
        assert len(cut) == 1800 and whole.startswith(cut) and len(whole) >= 1800
        # 4-space steps, at most one deeper than the line before: what --reindent makes of the
        # stdlib, so the two kinds of code rows share one indentation
        assert corpus.reindent(whole) == whole


def test_the_same_seed_gives_the_same_module():
    a = simple_code.module(random.Random(3), 3000)
    assert a == simple_code.module(random.Random(3), 3000)
    assert a != simple_code.module(random.Random(4), 3000)


def test_data_refuses_a_simple_code_share_out_of_range():
    with pytest.raises(ValueError, match="simple_code is a share of the plain code rows"):
        td.Data(0, simple_code=1.5)  # before the corpus loads
