"""What a training job is: typed config, model families, user models."""
