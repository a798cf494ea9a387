"""The plan: what a run needs, decided once.

- `schema`: the Plan's typed sections and run.yaml I/O (`dump_plan`, `load_plan`). The trainer, the
  renderers, `dskit status` and `dskit report` import only this.
- `build`: the decisions (`build_plan`, `build_plan_searched`), from the spec and the catalogs, through
  `parallel` (the parallel section: batch split, overrides), `search` (the candidates and which one),
  `fit`/`memory`/`host_memory` (what fits), `adapters` (what LoRA trains), `speed` (how fast),
  `deepspeed` (the DeepSpeed config), `hang_timeout` (the watchdog's timeout). They compute with the
  model's `shape` (its config.json's dimensions, read once) and, per candidate of the search, the
  `candidate` module's Candidate, Workload and Cluster.
- `explain`: `dskit plan --explain` and `--plot`, the search's candidates as a table (computes nothing).
What both sides need lies below the plan: refusals in dskit/refusals.py, the launch contract's rules
(the collective timeout, exit codes) in dskit/launch/contract.py. tests/test_layers.py enforces this.
"""
