"""Training: one worker's loop on a DeepSpeed engine."""
