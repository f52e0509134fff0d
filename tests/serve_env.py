"""The serving environment the Triton tests need (`make serve-env` -> .venv-serve: Python 3.12 + PyTriton)."""

from __future__ import annotations

import os

import pytest

from xdeploy.core.errors import XDeployError
from xdeploy.serve.server import serve_python


def require_serve_env() -> str:
    """The serving interpreter; outside CI a machine without it skips the test with serve_python's reason (what
    is missing and `make serve-env`). `make test` creates it, so in CI a missing env fails instead."""
    try:
        return serve_python()
    except XDeployError as e:
        if os.environ.get("CI"):
            raise
        pytest.skip(str(e))
