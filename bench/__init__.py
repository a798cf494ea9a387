"""The benchmark scripts, importable: what the tests check of bench (the calibration rows and their
re-predictions, the optimizer and CPU refits, the cluster and pipeline tables on paper) they import from
here, never by running a script as a program. Each script's command line is its `main()`, run as
`python bench/SCRIPT.py`; a script reaches its siblings as `from bench import runs`. Nothing under dskit/
imports bench (tests/test_layers.py holds both directions)."""
