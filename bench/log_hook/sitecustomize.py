"""Loaded by every Python process whose path starts with this folder: with DSKIT_BENCH_LOG_RECORDS set,
the trainer's log window writes its records as that value says, whatever the device, and says so once
on stderr as it does:
- `at-step`: each record at its own step, the GPU's figures read at once, as before records went a log
  step late (dskit/train/metrics.py `LogWindow`): the other side of that lever's A/B, measured in the same
  call (bench/peer_bench.py --at-step-logs);
- `late`: a step late on CPU ranks too, which otherwise write at their step: the GPU's path, run by the
  CPU tests (tests/train/test_train.py) against a reference run written at its steps."""

import os

WHEN = os.environ.get("DSKIT_BENCH_LOG_RECORDS")

if WHEN:
    import importlib.abc
    import sys

    if WHEN not in ("at-step", "late"):  # one line, not site's traceback around a SystemExit
        print(f"DSKIT_BENCH_LOG_RECORDS: {WHEN!r}; allowed: at-step, late", file=sys.stderr, flush=True)
        os._exit(2)

    def _patch(module) -> None:
        init = module.LogWindow.__init__

        def __init__(self, *a, **kw) -> None:
            init(self, *a, **kw)
            self.deferred = WHEN == "late"
            print(f"bench/log_hook: log records {WHEN}", file=sys.stderr, flush=True)

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
                _patch(module)

            spec.loader.exec_module = exec_module
            return spec

    sys.meta_path.insert(0, _Patch())
