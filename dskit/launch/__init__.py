"""The launch contract every target renders and the trainer reads, and the launchers' entries."""
