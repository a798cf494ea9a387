"""File formats read without torch: a run's checkpoints and a Hugging Face checkpoint's headers."""
