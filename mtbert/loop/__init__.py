"""The one training loop (:class:`~mtbert.loop.training_group.TrainingGroup`): trials
started, stepped by an engine, evaluated and finished -- a solo trial (``Trainer``, its own
engine: eager or captured CUDA graphs), a fused group of trials, and a trial that cannot
fuse trained alone in the fused path's trainer.  Beside it, which configurations fuse and
a worker's kept step graphs."""
