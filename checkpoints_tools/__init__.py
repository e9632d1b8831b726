"""checkpoints_tools package."""
