"""Shared fixtures: one thread (two threads on two tiny cores are slower), tiny checkpoints on
disk."""

from __future__ import annotations

import importlib
import os

import pytest
import torch

from dist_glm5.backends import get_backend

torch.set_num_threads(1)

ORACLE_INSTALL = 'pip install -e ".[cpu,test,oracles]"'
# import name -> the distribution to install
ORACLE_PACKAGES = {
    "quark": "amd-quark",
    "torchao": "torchao",
    "transformers": "transformers",
    "ml_dtypes": "ml_dtypes",
    "openai": "openai",
}


def in_ci() -> bool:
    return os.environ.get("CI", "").strip().lower() not in ("", "0", "false", "no")


def require(module: str):
    """Import a third-party oracle module for a test, or say loudly why not.

    In CI (the CI environment variable set, as CI runs with CI=true) a failed import FAILS the test:
    a broken oracle install must not turn the suite green by skipping. Elsewhere it skips."""
    try:
        return importlib.import_module(module)
    except Exception as e:  # ImportError, or a broken install failing while it imports
        error = f"{type(e).__name__}: {e}"
    package = ORACLE_PACKAGES.get(module.split(".")[0], module.split(".")[0])
    msg = (
        f"oracle package {package!r} cannot be imported ({module}: {error}); "
        f"install the oracles with: {ORACLE_INSTALL}"
    )
    if in_ci():
        pytest.fail(msg, pytrace=False)
    pytest.skip(msg, allow_module_level=True)


@pytest.fixture(scope="session", autouse=True)
def _isolated_home(tmp_path_factory):
    # The embedded model is made once per test session in a private folder unless CI points
    # elsewhere.
    if "DIST_GLM5_HOME" not in os.environ:
        os.environ["DIST_GLM5_HOME"] = str(tmp_path_factory.mktemp("dist_glm5_home"))
    yield


@pytest.fixture(scope="session")
def default_model_dir():
    from dist_glm5.checkpoint.default_model import ensure_random_model

    return ensure_random_model()


@pytest.fixture(scope="session")
def default_model(default_model_dir):
    from dist_glm5.checkpoint.loader import load_model

    return load_model(default_model_dir, ops=get_backend("cpu").ops())
