"""What the end-to-end tiers share: the real 2-node Slurm cluster (tests/support/slurm_cluster.py), started
once for the run and kept by one worker (its tests form one xdist group: tests/support/scheduling.py)."""

from __future__ import annotations

import os

import pytest

from tests.support.slurm_cluster import SlurmCluster, missing_tools


@pytest.fixture(scope="session")
def cluster(tmp_path_factory):
    missing = missing_tools()
    if os.geteuid() != 0 or missing:
        if os.environ.get("CI"):
            pytest.fail(f"CI must run the Slurm tests: root={os.geteuid() == 0}, missing {missing}")
        pytest.skip(f"needs root and Debian slurm-wlm + munge (missing: {missing})")
    c = SlurmCluster(tmp_path_factory.mktemp("slurm"))
    c.up()
    try:
        yield c
    finally:
        c.down()
