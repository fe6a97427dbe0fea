"""What a run keeps: checkpoints, the training state, RNG streams, the run directory."""
