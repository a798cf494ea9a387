"""`dskit calibrate`: measure the cluster a plan runs on, and the plan's use of what was measured.

- `measures`: what a calibration job times, decided from the plan (the process-group shapes of every
  EP size the search weighs, message sizes around the plan's, the probes' fixed shapes);
- `job`: the job itself, on every rank (started like a training run; `python -m dskit.train` sees
  run.yaml's `calibrate` section and measures instead of training);
- `calibration`: the file it writes (calibration.json) and the one reader the plan uses;
- `scales`: what a file changes in the step-time model's fitted terms (dskit/plan/speed.py), and where
  each term's rate comes from, as `dskit plan --explain` prints it;
- `candidates`: `dskit calibrate local --candidates N`, the plan's top candidates trained for a few
  steps each, their measured speed recorded beside the prediction.

The command is dskit/cli/calibrate_cmd.py; the collective rates are used by dskit/plan/links.py.
"""
