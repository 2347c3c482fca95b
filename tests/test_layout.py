"""The floor plan holds: imports run one way (model math at the bottom, the command line on top),
the control plane imports no torch, and the README's layout table matches the tree."""

from __future__ import annotations

import ast
import re
import subprocess
import sys
import textwrap
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
# folder in the repository -> the package it installs as (pyproject's package-dir)
FOLDERS = {
    "dist_glm5": "dist_glm5",
    "engine": "dist_glm5.engine",
    "stages": "dist_glm5.stages",
    "convert": "dist_glm5.convert",
    "bench": "dist_glm5.bench",
    "launch": "dist_glm5.launch",
}
TOP_FLOORS = (
    "dist_glm5.engine",
    "dist_glm5.stages",
    "dist_glm5.convert",
    "dist_glm5.bench",
    "dist_glm5.launch",
)
# what each floor may not import (anything it imports must sit on its floor or below)
FORBIDDEN = {
    "dist_glm5": TOP_FLOORS,  # the core: model, ops, quant, checkpoint, planning, obs, sampling
    "dist_glm5.kernels": TOP_FLOORS,
    # the control plane sits under the workers that run its plans: it never imports them
    "dist_glm5.engine": (
        "dist_glm5.stages",
        "dist_glm5.convert",
        "dist_glm5.bench",
        "dist_glm5.launch",
    ),
    "dist_glm5.stages": ("dist_glm5.convert", "dist_glm5.bench", "dist_glm5.launch"),
    "dist_glm5.convert": (
        "dist_glm5.engine",
        "dist_glm5.stages",
        "dist_glm5.bench",
        "dist_glm5.launch",
    ),
    # launch and bench share the top floor; who of them may import whom: TOP_RULES below
}


def _modules(root: Path = ROOT):
    for folder, pkg in FOLDERS.items():
        for f in sorted((root / folder).rglob("*.py")):
            rel = f.relative_to(root / folder).with_suffix("")
            parts = [p for p in rel.parts if p != "__init__"]
            name = ".".join([pkg, *parts])
            yield pkg, name, f.name == "__init__.py", f


def _imports(name: str, is_pkg: bool, path: Path) -> set[str]:
    """Every module a file imports, at top level or inside functions, relative ones resolved."""
    out: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            out |= {a.name for a in node.names}
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = name.split(".") if is_pkg else name.split(".")[:-1]
                base = base[: len(base) - node.level + 1]
                mod = ".".join(base + ([node.module] if node.module else []))
            else:
                mod = node.module or ""
            out.add(mod)
            out |= {f"{mod}.{a.name}" for a in node.names}
    return out


def _floor(name: str) -> str:
    for pkg in sorted(FOLDERS.values(), key=len, reverse=True):
        if name == pkg or name.startswith(pkg + "."):
            return pkg
    return name


def test_imports_run_one_way():
    bad = []
    for _pkg, name, is_pkg, path in _modules():
        for mod in _imports(name, is_pkg, path):
            if any(mod == f or mod.startswith(f + ".") for f in FORBIDDEN.get(_floor(name), ())):
                bad.append(f"{path.relative_to(ROOT)} imports {mod}")
    assert not bad, "imports against the floor plan:\n" + "\n".join(bad)


def test_the_checker_sees_a_violation(tmp_path):
    # negative control: a core file importing the command line is caught, lazily or not
    f = tmp_path / "x.py"
    f.write_text("def f():\n    from dist_glm5.launch import cli\n")
    mods = _imports("dist_glm5.model.x", False, f)
    assert any(m.startswith("dist_glm5.launch") for m in mods)
    f.write_text("from ..launch import cli\n")
    assert "dist_glm5.launch" in _imports("dist_glm5.model.x", False, f)


def test_model_math_has_no_distribution_or_profiler():
    bad = []
    for _pkg, name, is_pkg, path in _modules():
        if name.startswith("dist_glm5.model"):
            for mod in _imports(name, is_pkg, path):
                if mod.startswith(("dist_glm5.obs", "torch.distributed", "dist_glm5.stages")):
                    bad.append(f"{path.relative_to(ROOT)} imports {mod}")
    assert not bad, "\n".join(bad)


def test_control_plane_imports_no_torch():
    code = textwrap.dedent("""
        import sys
        class Block:
            def find_spec(self, name, path=None, target=None):
                if name == "torch" or name.startswith("torch."):
                    raise ImportError("torch is blocked in this test")
        sys.meta_path.insert(0, Block())
        import dist_glm5.engine.scheduler, dist_glm5.engine.coordinator, dist_glm5.engine.messages
        import dist_glm5.engine.pipeline, dist_glm5.sampling.params, dist_glm5.engine.config
        import dist_glm5.engine.metrics, dist_glm5.model.block_manager
        import dist_glm5.engine.detokenizer, dist_glm5.checkpoint.tokenizer
        import dist_glm5.engine.loop, dist_glm5.engine
        from dist_glm5.engine.scheduler import Scheduler, SchedulerConfig, Sequence
        from dist_glm5.sampling.params import SamplingParams
        s = Scheduler(SchedulerConfig(), (0,), num_blocks=4, block_size=16)
        s.add(Sequence(0, [1, 2, 3], SamplingParams(max_tokens=4)))  # a request, planned
        assert s.next_plan(0).work[0].blocks == [0]
        assert "torch" not in sys.modules
        print("ok")
    """)
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0 and r.stdout.strip() == "ok", r.stderr


def test_readme_layout_table_matches_tree():
    text = (ROOT / "README.md").read_text()
    section = text.split("## Layout", 1)[1].split("\n## ", 1)[0]
    rows = re.findall(r"^\| `([^`]+)` \|", section, flags=re.M)
    listed = {r.rstrip("/") for r in rows}
    assert listed, "README has no layout table"
    for r in listed:
        assert (ROOT / r).exists(), f"README's layout table lists {r}, which is not in the tree"
    expected = (
        set(FOLDERS)
        | {"tests"}
        | {
            f"dist_glm5/{d.name}"
            for d in (ROOT / "dist_glm5").iterdir()
            if d.is_dir() and (d / "__init__.py").exists()
        }
    )
    missing = expected - listed
    assert not missing, f"folders missing from README's layout table: {sorted(missing)}"


# ---- the core's rooms: who may import whom ----------------------------------------------------
# (importer, what it may not import, why). The hot-ops seam is a leaf under the model; the model
# is handed its ops and picks no backend; a kernel gets its fallback passed in; sampling reads a
# tokenizer by what it offers.
RULES = [
    ("dist_glm5.model", "dist_glm5.backends", "the model is handed its ops (Glm5Model(ops=))"),
    ("dist_glm5.ops", "dist_glm5.model", "the references live in ops/; the model imports them"),
    ("dist_glm5.kernels", "dist_glm5.ops", "a kernel's fallback is passed in (fallback=)"),
    ("dist_glm5.kernels", "dist_glm5.backends", "the backend picks the kernel, not the reverse"),
    ("dist_glm5.sampling", "dist_glm5.checkpoint", "grammar reads a tokenizer by what it offers"),
]
# the core's subpackages, between which no import may run in a circle
CORE = ("model", "ops", "quant", "checkpoint", "planning", "obs", "sampling", "backends", "kernels")


def _inside(mod: str, pkg: str) -> bool:
    return mod == pkg or mod.startswith(pkg + ".")


def _package_imports(root: Path = ROOT) -> dict[str, set[str]]:
    """module -> what it imports, for the modules of the installed package only: a file in a
    folder without __init__.py (kernels/tpc/torch_op/setup.py, a build script run by hand on a
    Gaudi image) is no module anyone imports, so it can tie no knot."""
    out = {}
    for _pkg, name, is_pkg, path in _modules(root):
        folder = next(f for f, p in FOLDERS.items() if p == _pkg)
        d = path.parent
        while d != root / folder and (d / "__init__.py").exists():
            d = d.parent
        if d == root / folder:
            out[name] = _imports(name, is_pkg, path)
    return out


def _rule_violations(imports: dict[str, set[str]]) -> list[str]:
    return sorted(
        f"{name} imports {mod}: {why}"
        for name, mods in imports.items()
        for src, dst, why in RULES
        if _inside(name, src)
        for mod in mods
        if _inside(mod, dst)
    )


def _room(name: str) -> str | None:
    parts = name.split(".")
    return parts[1] if len(parts) > 1 and parts[0] == "dist_glm5" and parts[1] in CORE else None


def _circles(imports: dict[str, set[str]]) -> list[list[str]]:
    """Circles of imports between the core's subpackages (each circle once, as a room path)."""
    arrows: dict[str, set[str]] = {}
    for name, mods in imports.items():
        a = _room(name)
        for mod in mods:
            b = _room(mod)
            if a and b and a != b:
                arrows.setdefault(a, set()).add(b)
    found = []

    def walk(path: list[str]) -> None:
        for b in sorted(arrows.get(path[-1], ())):
            if b == path[0]:
                found.append(path + [b])
            elif b not in path and b > path[0]:  # each circle from its smallest room only
                walk(path + [b])

    for a in sorted(arrows):
        walk([a])
    return found


def test_core_rooms_keep_their_rules():
    bad = _rule_violations(_package_imports())
    assert not bad, "imports against the core's rules:\n" + "\n".join(bad)


def test_no_import_circle_among_the_core_subpackages():
    circles = _circles(_package_imports())
    assert not circles, "import circles: " + "; ".join(" -> ".join(c) for c in circles)


def test_the_rules_and_the_circle_check_catch_violations(tmp_path):
    # negative control: a synthetic tree breaking each rule (lazily, relatively, as a package
    # import) and tying a circle; the checkers name every one of them
    files = {
        "dist_glm5/__init__.py": "",
        "dist_glm5/model/__init__.py": "",
        "dist_glm5/model/glm5.py": "def f():\n    from dist_glm5.backends import get_backend\n",
        "dist_glm5/ops/__init__.py": "from ..model import mla\n",
        "dist_glm5/sampling/__init__.py": "",
        "dist_glm5/sampling/grammar.py": "import dist_glm5.checkpoint.tokenizer\n",
        "dist_glm5/checkpoint/__init__.py": "",
        "dist_glm5/backends/__init__.py": "from dist_glm5.kernels import mxfp4_moe\n",
        "dist_glm5/kernels/__init__.py": "",
        "dist_glm5/kernels/mxfp4_moe.py": "from dist_glm5.ops.experts import REFERENCE\n",
        "dist_glm5/kernels/dsa_select.py": "from dist_glm5 import backends\n",
        # a folder without __init__.py is no package: ignored
        "dist_glm5/kernels/tools/setup.py": "from dist_glm5.backends import hpu\n",
    }
    for rel, text in files.items():
        (tmp_path / rel).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / rel).write_text(text)
    for folder in FOLDERS:
        (tmp_path / folder).mkdir(exist_ok=True)
    imports = _package_imports(tmp_path)
    assert "dist_glm5.kernels.tools.setup" not in imports
    bad = {line.split(":")[0] for line in _rule_violations(imports)}
    assert bad == {
        "dist_glm5.model.glm5 imports dist_glm5.backends",
        "dist_glm5.model.glm5 imports dist_glm5.backends.get_backend",
        "dist_glm5.ops imports dist_glm5.model",
        "dist_glm5.ops imports dist_glm5.model.mla",
        "dist_glm5.sampling.grammar imports dist_glm5.checkpoint.tokenizer",
        "dist_glm5.kernels.mxfp4_moe imports dist_glm5.ops.experts",
        "dist_glm5.kernels.mxfp4_moe imports dist_glm5.ops.experts.REFERENCE",
        "dist_glm5.kernels.dsa_select imports dist_glm5.backends",
    }, bad
    assert _circles(imports) == [
        ["backends", "kernels", "backends"],
        ["backends", "kernels", "ops", "model", "backends"],
    ]
    # and the real tree's rules are the ones the tests above hold it to
    assert {(a, b) for a, b, _ in RULES} >= {
        ("dist_glm5.model", "dist_glm5.backends"),
        ("dist_glm5.ops", "dist_glm5.model"),
        ("dist_glm5.kernels", "dist_glm5.ops"),
        ("dist_glm5.kernels", "dist_glm5.backends"),
        ("dist_glm5.sampling", "dist_glm5.checkpoint"),
    }


# ---- the top floor: launch (what a user runs) and bench (what measures it) --------------------
# launch never imports bench: what both use (the roofline's bytes per step, the --ctx parser) sits
# below them. bench imports launch only where it must build or plan exactly what launch does;
# each such file is named with its reason (starting the server as a user does is a subprocess,
# `dist-glm5 launch ...`, and imports nothing).
TOP_RULES = [
    ("dist_glm5.launch", "dist_glm5.bench", "a command never depends on its benchmarks"),
    ("dist_glm5.bench", "dist_glm5.launch", "a benchmark runs launch as a user does (subprocess)"),
]
TOP_ALLOWED = [
    # (importer, what it may import of the other, why)
    ("dist_glm5.launch.cli", "dist_glm5.bench", "the command line's root registers `bench`"),
    # the host-only server: the server as `launch single-node` builds it, its worker swapped for
    # one without a model, which no flag of launch offers
    ("dist_glm5.bench.serve", "dist_glm5.launch.api", "the host-only server, built as launch's"),
    # the RSS-vs-plan ratio holds the job against the plan `launch batch` itself made
    ("dist_glm5.bench.long_job", "dist_glm5.launch.batch", "launch batch's own memory plan"),
]


def _top_violations(imports: dict[str, set[str]]) -> list[str]:
    return sorted(
        f"{name} imports {mod}: {why}"
        for name, mods in imports.items()
        for src, dst, why in TOP_RULES
        if _inside(name, src)
        for mod in mods
        if _inside(mod, dst)
        and not any(_inside(name, a) and _inside(mod, b) for a, b, _ in TOP_ALLOWED)
    )


def test_launch_and_bench_do_not_import_each_other():
    bad = _top_violations(_package_imports())
    assert not bad, "imports between launch and bench:\n" + "\n".join(bad)


def test_the_top_floor_check_catches_violations(tmp_path):
    # negative control: launch using a benchmark's module (lazily), bench using launch's parser
    # (absolutely and relatively); the named exceptions are not reported
    files = {
        "dist_glm5/__init__.py": "",
        "launch/__init__.py": "",
        "launch/cli.py": "def f():\n    from dist_glm5 import bench, launch\n",
        "launch/profile.py": "def f():\n    from dist_glm5.bench.roofline import HBM\n",
        "bench/__init__.py": "",
        "bench/engine_host.py": "from dist_glm5.launch.serve import parse_ctx\n",
        "bench/long_job.py": "from ..launch import serve\nfrom dist_glm5.launch import batch\n",
        "bench/serve.py": "def f():\n    from dist_glm5.launch.api.app import build_app\n",
    }
    for rel, text in files.items():
        (tmp_path / rel).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / rel).write_text(text)
    for folder in FOLDERS:
        (tmp_path / folder).mkdir(exist_ok=True)
    bad = {line.split(":")[0] for line in _top_violations(_package_imports(tmp_path))}
    assert bad == {
        "dist_glm5.launch.profile imports dist_glm5.bench.roofline",
        "dist_glm5.launch.profile imports dist_glm5.bench.roofline.HBM",
        "dist_glm5.bench.engine_host imports dist_glm5.launch.serve",
        "dist_glm5.bench.engine_host imports dist_glm5.launch.serve.parse_ctx",
        "dist_glm5.bench.long_job imports dist_glm5.launch",  # the package: not launch.batch
        "dist_glm5.bench.long_job imports dist_glm5.launch.serve",
    }, bad
    assert {(a, b) for a, b, _ in TOP_RULES} == {
        ("dist_glm5.launch", "dist_glm5.bench"),
        ("dist_glm5.bench", "dist_glm5.launch"),
    }
