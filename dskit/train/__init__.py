"""The in-container trainer. Imports torch/deepspeed lazily: `dskit` itself must stay light."""
