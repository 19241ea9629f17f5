"""What-if post-mortem of a training job's trace: how much time stragglers cost, and why."""
