"""System tools the tests drive (systemd-analyze, prometheus, promtool): skip locally without them, fail in CI."""

from __future__ import annotations

import os
import shutil

import pytest

IN_CI = os.environ.get("CI") == "true"
#: Debian package that provides each tool (.ci/run installs them).
PACKAGES = {"systemd-analyze": "systemd", "prometheus": "prometheus", "promtool": "prometheus"}


def need(tool: str) -> str:
    """Path of ``tool``; skip the test locally without it, fail it in CI (CI=true), where .ci/run installs it."""
    path = shutil.which(tool)
    if path is None:
        pkg = PACKAGES.get(tool, tool)
        if IN_CI:
            pytest.fail(f"{tool} must be installed in CI (.ci/run: apt-get install {pkg})")
        pytest.skip(f"{tool} not installed (apt-get install {pkg}); CI runs this")
    return path
