"""The trainer's base: the error types, atomic file writes, ``TrainConfig`` (every field of
a run), the three tasks as data, the device a run computes on, and the pretrained encoder's
files and tokenizer.  The bottom of the layers (docs/architecture.md)."""
