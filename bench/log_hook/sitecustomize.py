"""Loaded by every Python process whose path starts with this folder (bench/peer_bench.py --at-step-logs
puts it on PYTHONPATH): with DSKIT_BENCH_LOGS_AT_STEP set, the trainer's log window writes each record at
its own step, reading the GPU's figures at once, as it did before records went a log step late
(dskit/train/metrics.py `LogWindow`): the other side of that lever's A/B, measured in the same call."""

import os

if os.environ.get("DSKIT_BENCH_LOGS_AT_STEP"):
    import importlib.abc
    import sys

    def _at_step(module) -> None:
        init = module.LogWindow.__init__

        def __init__(self, *a, **kw) -> None:
            init(self, *a, **kw)
            self.deferred = False

        module.LogWindow.__init__ = __init__

    class _Patch(importlib.abc.MetaPathFinder):
        """Patches dskit.train.metrics as it is imported (a rank imports it late, after this file runs)."""

        def find_spec(self, name, path, target=None):
            if name != "dskit.train.metrics":
                return None
            sys.meta_path.remove(self)
            import importlib.util

            spec = importlib.util.find_spec(name)
            load = spec.loader.exec_module

            def exec_module(module) -> None:
                load(module)
                _at_step(module)

            spec.loader.exec_module = exec_module
            return spec

    sys.meta_path.insert(0, _Patch())
