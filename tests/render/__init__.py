"""The renderers and their golden files: Slurm, Helm, Ray, images (dskit/render/)."""
