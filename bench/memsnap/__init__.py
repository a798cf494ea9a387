"""The allocator recorder: sitecustomize.py, loaded through PYTHONPATH into every trainer process by
bench/memory_peak.py; importable for its replay (`analyse`)."""
