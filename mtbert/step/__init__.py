"""What trains a trial's updates: the step engines (eager, captured CUDA graphs, N trials
fused on a trial axis with their stacked model, update and fused techniques).  The loop
that drives them is :mod:`mtbert.loop`'s."""
