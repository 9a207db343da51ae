"""The training loop and what it composes: launch, schedule, optimiser, metrics, dry run."""
