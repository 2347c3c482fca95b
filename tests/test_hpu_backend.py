"""Loading the hpu backend (with the fake, and without any Gaudi stack), its environment defaults,
the execution-mode plumbing, bucket tables, warm-up and the launch path."""

from __future__ import annotations

import logging

import hpu_fake
import pytest
import torch

from dist_glm5.backends import get_backend
from dist_glm5.backends.hpu import _hf, env, runtime, warmup
from dist_glm5.backends.hpu.buckets import BucketConfig, Exp, Linear, find_bucket

fake_hf = hpu_fake.fake_hf


def test_load_with_the_fake(fake_hf):
    b = get_backend("hpu")
    assert (b.name, b.device, b.dist_backend) == ("hpu", "hpu", "hccl")
    ops = b.ops()
    from dist_glm5.backends.hpu import indexer, moe

    assert ops.experts is moe.HPU_EXPERTS and ops.select_topk is indexer.select_topk


def test_without_the_stack_the_error_says_what_is_missing():
    hpu_fake.uninstall()
    with pytest.raises(RuntimeError, match="habana_frameworks.*--backend cpu"):
        get_backend("hpu")
    with pytest.raises(RuntimeError, match="habana_frameworks"):
        _hf.fused_sdpa()


def test_env_defaults_only_where_unset_and_logged(caplog):
    with caplog.at_level(logging.INFO, logger=env.__name__):
        e: dict[str, str] = {}
        assert (
            env.apply_defaults(e)
            == e
            == {
                "PT_HPU_LAZY_MODE": "1",
                "PT_HPU_ENABLE_LAZY_COLLECTIVES": "true",
            }
        )
    assert "PT_HPU_LAZY_MODE=1 (default" in caplog.text
    e = {"PT_HPU_LAZY_MODE": "0"}  # compiled mode: no lazy collectives default
    assert env.apply_defaults(e) == {} and e == {"PT_HPU_LAZY_MODE": "0"}
    e = {"PT_HPU_ENABLE_LAZY_COLLECTIVES": "false"}
    assert env.apply_defaults(e) == {"PT_HPU_LAZY_MODE": "1"}
    assert e["PT_HPU_ENABLE_LAZY_COLLECTIVES"] == "false"


@pytest.mark.parametrize("lazy", ["0", "1"])
def test_runtime_mode_plumbing(fake_hf, monkeypatch, lazy):
    monkeypatch.setenv("PT_HPU_LAZY_MODE", lazy)
    m = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Linear(4, 4))
    runtime.mark_step()
    hooks = runtime.add_layer_mark_steps(list(m))
    m(torch.zeros(1, 4))
    names = [r[0] for r in fake_hf.RECORD]
    if lazy == "1":
        assert names == ["core.mark_step"] * 3
        assert len(hooks) == 2
    else:  # compiled mode: no graphs, no mark_step
        assert names == [] and hooks == []
        f = runtime.compile_region(lambda x: x + 1)
        assert torch.equal(f(torch.zeros(2)), torch.ones(2))
        assert [r[0] for r in fake_hf.RECORD] == ["compile.hpu_backend"]


def test_bucket_tables_up_to_637k():
    cfg = BucketConfig()
    for name in ("prompt_bs", "prompt_query", "prompt_ctx", "decode_bs", "decode_ctx"):
        t = cfg.table(name)
        assert list(t) == sorted(set(t)) and t[0] >= 1
    blocks = -(-652_288 // 128)
    assert cfg.table("decode_ctx")[-1] == blocks == 5096
    assert cfg.table("prompt_query") == (
        128,
        256,
        512,
        1024,
        2048,
        3072,
        4096,
        5120,
        6144,
        7168,
        8192,
    )
    assert BucketConfig() == cfg
    for dim in (Linear(1, 32, 64), Exp(1, blocks, 2), Linear(3, 10, 95)):
        t = dim.values()
        for n in (1, 2, 5, 31, 33, 64, 95, 1000, blocks):
            if n <= t[-1] and n >= t[0]:
                assert find_bucket(t, n) >= n
                assert all(v < n for v in t if v < find_bucket(t, n))
    with pytest.raises(ValueError, match="above the largest bucket"):
        find_bucket(cfg.table("decode_bs"), 65)
    env_cfg = BucketConfig.from_env(
        {
            "DIST_GLM5_DECODE_BS_BUCKET_MIN": "2",
            "DIST_GLM5_DECODE_BS_BUCKET_STEP": "8",
            "DIST_GLM5_DECODE_BS_BUCKET_MAX": "24",
        }
    )
    assert env_cfg.table("decode_bs") == (2, 4, 8, 16, 24)
    with pytest.raises(ValueError, match="set all of"):
        BucketConfig.from_env({"DIST_GLM5_DECODE_BS_BUCKET_MIN": "2"})


def test_warmup_runs_each_bucket_once_under_compile_only(fake_hf, tmp_path, caplog):
    timer = tmp_path / "timeout_locked"
    timer.write_text("600\n")
    assert warmup.read_timeout_locked(timer) == 600
    assert warmup.read_timeout_locked(tmp_path / "absent") is None
    ran = []
    # a fake clock that advances one step per reading: nothing here measures real time; the test
    # checks that warm-up reports every bucket and judges each one's time against the timer
    step = 100
    ticks = iter(range(0, 10_000, step))
    with caplog.at_level(logging.INFO, logger=warmup.__name__):
        times = warmup.warmup(
            [(1, 8), (2, 8)], ran.append, timeout_s=150, clock=lambda: next(ticks)
        )
    assert ran == [(1, 8), (2, 8)]
    assert [t.bucket for t in times] == [(1, 8), (2, 8)]
    warned = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warned) == 2 and all("over 50% of timeout_locked=150" in w for w in warned)
    names = [r[0] for r in fake_hf.RECORD]
    one = [
        "bridge_config.env_setting.enter",
        "bridge_config.env_setting.exit",
        "core.mark_step",
        "hpu.synchronize",
    ]
    assert names == one * 2
    assert fake_hf.RECORD[0][1] == ("PT_COMPILE_ONLY_MODE", True)
    assert "over 50% of timeout_locked=150" in caplog.text


@pytest.mark.parametrize("command", ["single-node", "two-node"])
def test_launch_hpu_without_the_stack_and_with_the_fake(
    default_model_dir, capsys, caplog, monkeypatch, command
):
    """Without the Gaudi stack both commands stop before any worker starts, exit non-zero and name
    what is missing and the fix; with the fake they go on to serve the pipeline on hpu (the server
    itself is replaced here: the engine on hpu is test_hpu_pipeline's)."""
    from dist_glm5.launch import serve as serve_cmd
    from dist_glm5.launch.cli import main
    from dist_glm5.launch.engine_args import engine_config

    for k in ("PT_HPU_LAZY_MODE", "PT_HPU_ENABLE_LAZY_COLLECTIVES"):
        monkeypatch.delenv(k, raising=False)
    argv = ["launch", command, "--model", str(default_model_dir), "--backend", "hpu", "--ctx", "4k"]
    hpu_fake.uninstall()
    served = []
    monkeypatch.setattr(serve_cmd, "serve", lambda args, d, cfg: served.append(args) or 0)
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert "habana_frameworks" in err and "Gaudi" in err and "--backend cpu" in err
    assert served == []  # stopped before building anything
    monkeypatch.delenv("PT_HPU_LAZY_MODE")
    monkeypatch.delenv("PT_HPU_ENABLE_LAZY_COLLECTIVES")
    hpu_fake.install()
    try:
        assert main(argv) == 0
    finally:
        hpu_fake.uninstall()
    (args,) = served
    eng = engine_config(args, default_model_dir)
    assert eng.backend == "hpu" and eng.layout.stages == (2 if command == "two-node" else 1)
    assert eng.dsa.prefill_attention == "windows" and eng.dsa.static_union  # Gaudi's forms
    assert "hpu: PT_HPU_LAZY_MODE=1 (default" in caplog.text  # the defaults it set, said


def test_engine_config_names_a_known_backend():
    from dist_glm5.engine.config import EngineConfig

    assert EngineConfig("m").backend == "cpu"
    with pytest.raises(ValueError, match="backend 'tpu'.*--backend"):
        EngineConfig("m", backend="tpu")


def test_first_run_probes_run_on_the_fake(fake_hf):
    """The probes of the open items (run on the card with --device hpu) at toy sizes on the CPU:
    the script itself works and its references agree where nothing is Gaudi-specific."""
    from dist_glm5.backends.hpu import probe

    r = probe.mxfp4("cpu", H=512, I=256, E=4, k=2)
    assert all(row["rel_err"] < 2e-2 for row in r["rows"])
    r = probe.sdpa("cpu", n=16, L=64, h=2)
    assert set(r) == {"None", "fp32"} and all(v["worst_row_cos"] > 0.999 for v in r.values())
    r = probe.topk("cpu", L=5000, k=64, rows=2)
    assert r["bisection_exact"] and r["topk_exact"]
    assert probe.rmsnorm("cpu", D=64, T=8)["reference_order_bits_differ"] == 0
    assert probe.tpc("cpu") == {"built": False}
    assert "timeout_locked_s" in probe.timer("cpu")
