"""``dare plan``: per-GPU memory and FLOPs of a recipe at full size, simulated with the trainer's own code."""
