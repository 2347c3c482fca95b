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
    "kernels": "dist_glm5.kernels",
    "stages": "dist_glm5.stages",
    "convert": "dist_glm5.convert",
    "bench": "dist_glm5.bench",
    "launch": "dist_glm5.launch",
}
TOP_FLOORS = ("dist_glm5.stages", "dist_glm5.convert", "dist_glm5.bench", "dist_glm5.launch")
# what each floor may not import (anything it imports must sit on its floor or below)
FORBIDDEN = {
    "dist_glm5": TOP_FLOORS,  # the core: model, ops, quant, checkpoint, planning, obs, sampling
    "dist_glm5.kernels": TOP_FLOORS,
    "dist_glm5.stages": ("dist_glm5.convert", "dist_glm5.bench", "dist_glm5.launch"),
    "dist_glm5.convert": ("dist_glm5.stages", "dist_glm5.bench", "dist_glm5.launch"),
    # dist_glm5.bench sits beside launch on the top floor: it measures the server too
}


def _modules():
    for folder, pkg in FOLDERS.items():
        for f in sorted((ROOT / folder).rglob("*.py")):
            rel = f.relative_to(ROOT / folder).with_suffix("")
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
        import dist_glm5.stages.scheduler, dist_glm5.stages.coordinator, dist_glm5.stages.messages
        import dist_glm5.stages.pipeline, dist_glm5.sampling.params, dist_glm5.stages.engine_config
        import dist_glm5.stages.metrics, dist_glm5.model.block_manager
        import dist_glm5.checkpoint.detokenizer, dist_glm5.checkpoint.tokenizer
        from dist_glm5.stages.scheduler import Scheduler, SchedulerConfig, Sequence
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
