"""Simple Python modules, generated: a curriculum beside the stdlib's code (`--simple-code F`).

Why: a 3-hour run of the default model reads about 6 MB of text, a few MB of it the stdlib's
code, and at 1.9-2.0 bits a byte on it its next line after any snippet is nearly uniform over a
few generic lines, so greedy decoding writes the argmax line again and again (docs/
trained_default.md, sessions 20-34). A model this size writes well-formed code where the code it
learns is simple enough to model (TinyStories' finding for prose: Eldan and Li 2023). These
modules are that code: imports, functions and small classes in the stdlib's style (4-space
indents, docstrings, the common idioms: filter a list, build a dict, count, sum, find, join,
walk a chain, read a file), with names drawn from a fixed vocabulary, every module valid Python
(tests parse them with `ast`). `os.walk` is deliberately absent: the code gate's snippet ends in
an `os.walk` loop, so what the model writes after it must come from the idioms, not be recalled.
"""

from __future__ import annotations

import random
from dataclasses import dataclass

# (singular, plural) nouns: a loop's item and its collection
NOUNS = [
    ("item", "items"), ("value", "values"), ("name", "names"), ("path", "paths"),
    ("line", "lines"), ("record", "records"), ("word", "words"), ("key", "keys"),
    ("entry", "entries"), ("row", "rows"), ("token", "tokens"), ("node", "nodes"),
    ("user", "users"), ("task", "tasks"), ("event", "events"), ("field", "fields"),
    ("part", "parts"), ("child", "children"), ("module", "modules"), ("message", "messages"),
    ("option", "options"), ("header", "headers"), ("block", "blocks"), ("rule", "rules"),
    ("job", "jobs"), ("file", "files"), ("group", "groups"), ("tag", "tags"),
]  # fmt: skip
ATTRS = ["name", "size", "value", "key", "path", "count", "kind", "status", "text", "data",
         "parent", "title", "level", "offset", "label", "owner"]  # fmt: skip
VERBS = ["get", "find", "collect", "load", "parse", "count", "build", "make", "read", "split",
         "filter", "select", "format", "join", "check", "sort", "group", "merge"]  # fmt: skip
SUFFIXES = ['".py"', '".txt"', '".json"', '".cfg"', '"/"', '"_"', '"#"']
LIMITS = ["limit", "size", "minimum", "count", "depth", "width"]


@dataclass
class Fn:
    """What a function's body is about: its item and collection names, an attribute of the
    items, the collection's expression (a parameter, or self's), a limit parameter ("": none)."""

    x: str
    xs: str
    a: str
    src: str
    limit: str
    base: bool = False


class _Module:
    """The lines of one module, and the function names it has defined (later code calls them)."""

    def __init__(self, rng: random.Random):
        self.rng = rng
        self.lines: list[str] = []
        self.funcs: list[str] = []
        self.has_os = False  # `import os` at the top

    def pick(self, xs):
        return self.rng.choice(xs)

    def noun(self) -> tuple[str, str]:
        return self.pick(NOUNS)

    def cond(self, x: str, limit: str) -> str:
        return self.pick(
            [
                f"{x}.{self.pick(ATTRS)}",
                f"{x} is not None",
                f'not {x}.startswith("_")',
                f"{x}.endswith({self.pick(SUFFIXES)})",
                f"{x}.{self.pick(ATTRS)} > {limit}",
                f"isinstance({x}, str)",
                f"{x} not in result",
                f"len({x}) > {limit}",
            ]
        )

    def expr(self, x: str, base: bool) -> str:
        out = [x, f"{x}.{self.pick(ATTRS)}", f"str({x})", f"{x}.strip()", f"{x}.lower()"]
        out.append(f"({x}.{self.pick(ATTRS)}, {x})")
        if base:
            out.append(f"os.path.join(base, {x})")
        if self.funcs:  # a call of a function defined above
            out.append(f"{self.pick(self.funcs)}({x})")
        return self.pick(out)

    def emit(self, indent: int, text: str) -> None:
        self.lines.append(" " * (4 * indent) + text)

    def function(self, indent: int = 0, method: bool = False) -> None:
        """One function (a method of the class being written when method) of one of IDIOMS."""
        rng = self.rng
        x, xs = self.noun()
        kind = rng.randrange(len(IDIOMS))
        # the loop's collection: a parameter, or (a method) an attribute of self
        src = f"self.{xs}" if method and rng.random() < 0.5 else xs
        f = Fn(x, xs, self.pick(ATTRS), src, self.pick(LIMITS) if rng.random() < 0.5 else "")
        f.base = self.has_os and kind == 0 and rng.random() < 0.3  # os.path.join(base, x)
        params = [] if src != xs else [xs]
        if IDIOMS[kind] is _chain:  # a chain starts at one item
            params, f.src = [x], x
        elif IDIOMS[kind] is _read:
            params = ["path"]
        elif IDIOMS[kind] is _first:
            params.append(f.a)
        params += ([f.limit] if f.limit and IDIOMS[kind] in (_filter, _total) else []) + (
            ["base"] if f.base else []
        )
        name = f"{self.pick(VERBS)}_{xs if rng.random() < 0.7 else x}"
        self.emit(indent, f"def {name}({', '.join((['self'] if method else []) + params)}):")
        for depth, text in IDIOMS[kind](self, f):
            self.emit(indent + 1 + depth, text)
        if not method:  # a later function may call it (a method only through its object)
            self.funcs.append(name)

    def klass(self) -> None:
        x, xs = self.noun()
        attrs = self.rng.sample(ATTRS, self.rng.randrange(2, 4))
        cls = x.capitalize() + self.pick(["", "Set", "List", "Table", "Index", "Group"])
        self.emit(0, f"class {cls}:")
        self.emit(1, f'"""A {x} with its {", ".join(attrs)}."""')
        self.lines.append("")
        self.emit(1, f"def __init__(self, {', '.join(attrs)}=None):")
        for a in attrs:
            self.emit(2, f"self.{a} = {a}")
        self.lines.append("")
        self.emit(1, "def __repr__(self):")
        self.emit(2, f'return f"{cls}({{self.{attrs[0]}!r}})"')
        for _ in range(self.rng.randrange(0, 3)):
            self.lines.append("")
            self.function(indent=1, method=True)


# ---- the idioms: each a function body, as (depth below the def, line) ----------------------
Body = list[tuple[int, str]]


def _filter(m: _Module, f: Fn) -> Body:  # filter and map into a list
    x, lim = f.x, f.limit or "0"
    out = [(0, f'"""Return the {f.a} of every {x} in {f.xs}."""')]
    if m.rng.random() < 0.3:
        out += [(0, f"if not {f.src}:"), (1, "return []")]
    out += [(0, "result = []"), (0, f"for {x} in {f.src}:")]
    if m.rng.random() < 0.6:
        out += [(1, f"if {m.cond(x, lim)}:"), (2, f"result.append({m.expr(x, f.base)})")]
    else:
        out += [(1, f"result.append({x}.{f.a})")]
    return out + [(0, "return result")]


def _table(m: _Module, f: Fn) -> Body:  # a dict by key
    return [
        (0, f'"""Map each {f.x}\'s {f.a} to the {f.x}."""'),
        (0, "table = {}"),
        (0, f"for {f.x} in {f.src}:"),
        (1, f"table[{f.x}.{f.a}] = {f.x}"),
        (0, "return table"),
    ]


def _count(m: _Module, f: Fn) -> Body:
    x, a = f.x, f.a
    return [
        (0, f'"""Count the {f.xs} by {a}."""'),
        (0, "counts = {}"),
        (0, f"for {x} in {f.src}:"),
        (1, f"counts[{x}.{a}] = counts.get({x}.{a}, 0) + 1"),
        (0, "return counts"),
    ]


def _total(m: _Module, f: Fn) -> Body:
    x, a = f.x, f.a
    out = [(0, f'"""Return the total {a} of {f.xs}."""'), (0, "total = 0")]
    out += [(0, f"for {x} in {f.src}:")]
    if f.limit:
        out += [(1, f"if {x}.{a} > {f.limit}:"), (2, f"total += {x}.{a}")]
    else:
        out += [(1, f"total += {x}.{a}")]
    return out + [(0, "return total")]


def _first(m: _Module, f: Fn) -> Body:  # the first match
    x, a = f.x, f.a
    return [
        (0, f'"""Return the first {x} with this {a}, or None."""'),
        (0, f"for {x} in {f.src}:"),
        (1, f"if {x}.{a} == {a}:"),
        (2, f"return {x}"),
        (0, "return None"),
    ]


def _join(m: _Module, f: Fn) -> Body:
    sep = m.pick(['", "', '"\\n"', '" "', '"/"', '"."'])
    return [
        (0, f'"""Join the {f.xs} into one string."""'),
        (0, "parts = []"),
        (0, f"for {f.x} in {f.src}:"),
        (1, f"parts.append(str({f.x}.{f.a}))"),
        (0, f"return {sep}.join(parts)"),
    ]


def _pairs(m: _Module, f: Fn) -> Body:
    src = f.src
    k, v, it = m.pick(
        [
            ("key", "value", f"{src}.items()"),
            ("name", f.x, f"{src}.items()"),
            ("index", f.x, f"enumerate({src})"),
            ("left", "right", f"zip({src}, {src}[1:])"),
        ]
    )
    return [
        (0, f'"""Return the {f.xs} as pairs."""'),
        (0, "pairs = []"),
        (0, f"for {k}, {v} in {it}:"),
        (1, f"pairs.append(({k}, {v}))"),
        (0, "return pairs"),
    ]


def _chain(m: _Module, f: Fn) -> Body:  # walk a chain of parents
    x = f.x
    return [
        (0, f'"""Return the {f.a} of {x} and of each of its parents."""'),
        (0, "chain = []"),
        (0, f"while {x} is not None:"),
        (1, f"chain.append({x}.{f.a})"),
        (1, f"{x} = {x}.parent"),
        (0, "return chain"),
    ]


def _read(m: _Module, f: Fn) -> Body:  # read a file
    ret = m.pick(["return f.read().splitlines()", "return [line.strip() for line in f]"])
    return [
        (0, f'"""Read the {f.xs} from a file, or None if it cannot be read."""'),
        (0, "try:"),
        (1, "with open(path) as f:"),
        (2, ret),
        (0, "except OSError:"),
        (1, "return None"),
    ]


def _unique(m: _Module, f: Fn) -> Body:  # unique, then sorted
    x, a = f.x, f.a
    return [
        (0, f'"""Return the {f.xs} without repeats, sorted by {a}."""'),
        (0, "seen = set()"),
        (0, "result = []"),
        (0, f"for {x} in {f.src}:"),
        (1, f"if {x}.{a} not in seen:"),
        (2, f"seen.add({x}.{a})"),
        (2, f"result.append({x})"),
        (0, f"result.sort(key=lambda {x}: {x}.{a})"),
        (0, "return result"),
    ]


IDIOMS = [_filter, _table, _count, _total, _first, _join, _pairs, _chain, _read, _unique]


def module(rng: random.Random, n_bytes: int, cut: bool = True) -> bytes:
    """A module of imports, functions and classes, at least n_bytes long, cut at n_bytes (cut:
    the whole of its last function or class kept otherwise)."""
    m = _Module(rng)
    imports = ["import os", "import re", "import sys", "import json", "import logging"]
    m.lines += sorted(rng.sample(imports, rng.randrange(1, 4)))
    m.has_os = "import os" in m.lines
    size = sum(len(line) + 1 for line in m.lines)  # the text's length so far (ASCII)
    while size < n_bytes:
        start = len(m.lines)
        m.lines += ["", ""]
        if rng.random() < 0.25:
            m.klass()
        else:
            m.function()
        size += sum(len(line) + 1 for line in m.lines[start:])
    text = ("\n".join(m.lines) + "\n").encode()
    return text[:n_bytes] if cut else text
