"""Checkpoints: atomic save/load around DeepSpeed, resharding onto another world or EP size through the
universal checkpoint, and starting from a Hugging Face checkpoint."""
