"""What trains a trial's updates: the step engines (eager, captured CUDA graphs, N trials
fused on a trial axis with their stacked model, update and fused techniques), and the two
runs they drive: ``Trainer`` (one trial, its own engine) and the fused groups."""
