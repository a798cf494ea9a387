"""End to end: the real 2-node Slurm cluster, the local Ray cluster, the built image and wheel."""
