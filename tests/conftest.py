"""Shared fixtures: one thread (two threads on two tiny cores are slower), tiny checkpoints on disk."""

from __future__ import annotations

import os

import pytest
import torch

torch.set_num_threads(1)


@pytest.fixture(scope="session", autouse=True)
def _isolated_home(tmp_path_factory):
    # The embedded model is made once per test session in a private folder unless CI points elsewhere.
    if "DIST_GLM5_HOME" not in os.environ:
        os.environ["DIST_GLM5_HOME"] = str(tmp_path_factory.mktemp("dist_glm5_home"))
    yield


@pytest.fixture(scope="session")
def default_model_dir():
    from dist_glm5.checkpoint.default_model import ensure_default_model

    return ensure_default_model()


@pytest.fixture(scope="session")
def default_model(default_model_dir):
    from dist_glm5.checkpoint.loader import load_model

    return load_model(default_model_dir)
