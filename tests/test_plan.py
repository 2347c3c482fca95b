"""The planner on GLM-5's config (tests/fixtures/glm5/config.json, no weights) for Gaudi 2 nodes."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from dist_glm5.model.config import ModelConfig
from dist_glm5.planning.cluster_fit import GB, Hardware, Layout, check, plan
from dist_glm5.planning.worker_memory import model_weight_bytes

FIXTURE = Path(__file__).parent / "fixtures" / "glm5"
GAUDI2 = Hardware()


@pytest.fixture(scope="module")
def cfg():
    return ModelConfig.from_hf(FIXTURE)


def test_mxfp4_weights_about_422_gb_and_53_per_card(cfg):
    total = model_weight_bytes(cfg, "mxfp4") / GB  # main model, MTP layer not counted
    assert abs(total - 422) / 422 < 0.02, total
    assert abs(total / 8 - 53) < 1.0
    card = plan(cfg, Layout(1, GAUDI2), 131072, "mxfp4")[0].memory.weights / GB
    # on a card: 1/8 of everything sharded, plus the replicated q_a/kv_a/indexer/router and the MTP
    # layer
    assert 53 <= card <= 60, card


def test_fp8_release_does_not_fit_one_node(cfg):
    with pytest.raises(ValueError, match="does not fit 1 node"):
        check(cfg, Layout(1, GAUDI2), 131072, "fp8")


def test_128k_fits_one_node_and_637k_fits_two_not_one(cfg):
    assert all(c.fits for c in check(cfg, Layout(1, GAUDI2), 131072, "mxfp4"))
    with pytest.raises(
        ValueError, match=r"637K context does not fit 1 node.*GB more than it has.*2 nodes fit 637K"
    ):
        check(cfg, Layout(1, GAUDI2), 652288, "mxfp4")
    cards = check(cfg, Layout(2, GAUDI2), 652288, "mxfp4")
    assert len(cards) == 2 and all(c.fits for c in cards)
    mla = plan(cfg, Layout(1, GAUDI2), 131072, "mxfp4")[0].memory.mla_cache / GB
    assert 11 < mla < 13.5, (
        mla
    )  # ~11.5 GB of MLA cache per card at 128K (1,152 B per token per layer)


def test_dry_run_from_a_directory_with_only_config_json(tmp_path):
    (tmp_path / "config.json").write_text((FIXTURE / "config.json").read_text())
    launch = [
        sys.executable,
        "-c",
        "import sys; from dist_glm5.launch.cli import launch_main; sys.exit(launch_main())",
    ]
    r = subprocess.run(
        [
            *launch,
            "single-node",
            "--model",
            str(tmp_path),
            "--ctx",
            "128k",
            "--backend",
            "hpu",
            "--dry-run",
            "--weights-format",
            "mxfp4",
        ],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert r.returncode == 0, r.stderr
    assert "128K context" in r.stdout and "yes" in r.stdout and "computed, not measured" in r.stdout
    r = subprocess.run(
        [
            *launch,
            "single-node",
            "--model",
            str(tmp_path),
            "--ctx",
            "637k",
            "--backend",
            "hpu",
            "--dry-run",
            "--weights-format",
            "mxfp4",
        ],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert r.returncode == 2 and "2 nodes fit 637K" in r.stderr and "NO" in r.stdout
    r = subprocess.run(
        [
            *launch,
            "two-node",
            "--model",
            str(tmp_path),
            "--ctx",
            "637k",
            "--backend",
            "hpu",
            "--dry-run",
            "--weights-format",
            "mxfp4",
        ],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert r.returncode == 0, r.stderr


def test_weight_format_from_quantization_config(cfg):
    from dist_glm5.planning.cluster_fit import weights_format_of

    raw = cfg.to_hf()
    assert (
        weights_format_of(
            ModelConfig.from_hf({**raw, "quantization_config": {"quant_method": "quark"}})
        )
        == "mxfp4"
    )
    assert (
        weights_format_of(
            ModelConfig.from_hf(
                {
                    **raw,
                    "quantization_config": {
                        "quant_method": "fp8",
                        "fmt": "e4m3",
                        "weight_block_size": [128, 128],
                    },
                }
            )
        )
        == "fp8"
    )
    assert weights_format_of(cfg) == "bf16"


@pytest.mark.parametrize("text,n", [("128k", 131072), ("637k", 652288), ("131072", 131072)])
def test_context_sizes(text, n):
    from dist_glm5.launch.serve import parse_ctx

    assert parse_ctx(text) == n
