"""Loaded by every Python process whose path starts with this folder (bench/sync_sites.py puts it on
PYTHONPATH): with DSKIT_SYNC_SITES set, counts each synchronising CUDA call (torch's sync debug mode) by
the Python stack that made it, and writes the counts to DSKIT_SYNC_SITES/<pid>.json at exit."""

import os

if os.environ.get("DSKIT_SYNC_SITES"):
    import atexit
    import collections
    import json
    import traceback
    import warnings

    import torch

    _sites: collections.Counter = collections.Counter()
    _show = warnings._showwarnmsg

    def _count(msg) -> None:
        if "synchronizing CUDA operation" not in str(msg.message):
            return _show(msg)
        frames = traceback.extract_stack()[:-1]  # all but this hook: the C warnings module adds no frame
        _sites["\n".join(f"{f.filename}:{f.lineno} {f.name}" for f in frames[-12:])] += 1

    def _write() -> None:
        if _sites:
            out = os.path.join(os.environ["DSKIT_SYNC_SITES"], f"{os.getpid()}.json")
            with open(out, "w") as f:
                json.dump(dict(_sites), f)

    warnings._showwarnmsg = _count
    warnings.filterwarnings("always", message=".*synchronizing CUDA operation.*")
    # at CUDA's lazy initialisation, not now: a process that never uses the GPU (torchrun's agent) keeps
    # no context on it
    torch.cuda._lazy_call(lambda: torch._C._cuda_set_sync_debug_mode(1))
    atexit.register(_write)
