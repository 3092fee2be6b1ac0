"""Training: datasets, optimizers, schedules, the trainer loop."""
