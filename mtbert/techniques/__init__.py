"""The training techniques, each one interface: the task losses and their weighting, the
gradient combiners (PCGrad), SMART, the task and learning-rate schedules, and the
pre-training stages."""
