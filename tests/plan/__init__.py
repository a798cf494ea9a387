"""The planner: memory, speed, fit, search, and its calibration against measured runs (dskit/plan/)."""
