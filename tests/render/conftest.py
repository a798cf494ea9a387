"""What the chart's pod tests share: the two network-namespace hosts their pods run on
(tests/support/k8s_pods.py). One set of names and addresses on the machine, so the tests that use them
form one xdist group (tests/support/scheduling.py `SHARED`)."""

from __future__ import annotations

import os
import shutil

import pytest


@pytest.fixture
def pod_hosts() -> None:
    """The pod tests need root and these tools (network namespaces); CI must have them."""
    tools = ("nsenter", "unshare", "ip", "mount", "getent")
    missing = [t for t in tools if not shutil.which(t, path=f"{os.environ.get('PATH', '')}:/usr/sbin:/sbin")]
    if os.geteuid() != 0 or missing:
        if os.environ.get("CI"):
            pytest.fail(f"CI must run the pod tests: root={os.geteuid() == 0}, missing {missing}")
        pytest.skip(f"needs root and {', '.join(tools)} (missing: {missing})")
