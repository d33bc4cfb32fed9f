"""Each trial's torch random stream: what a solo run holds as torch's global generator.

A solo run draws its random numbers (initial weights, data order, dropout, SMART's initial
noise, PCGrad's task orders) from torch's global generator, seeded by its trainer.  Trials
trained together in one process each keep their own copy of that stream
(:class:`TrialStreams`, taken right after the trial's construction) and run their draws
and bookkeeping on it (:meth:`TrialStreams.of`), so a fused trial draws what its solo run
draws and its checkpoints hold its own stream.  The state is torch's CPU generator's and,
on CUDA, the device's.
"""

from __future__ import annotations

import contextlib

import torch


def _rng_state(device: torch.device):
    cuda = torch.cuda.get_rng_state(device) if device.type == "cuda" else None
    return torch.get_rng_state(), cuda, device


def _set_rng_state(state) -> None:
    cpu, cuda, device = state
    torch.set_rng_state(cpu)
    if cuda is not None:
        torch.cuda.set_rng_state(cuda, device)


class TrialStreams:
    """Each fused trial's torch random stream (CPU, and the device's on CUDA), as its solo
    run would hold the global one, by trial; :meth:`of` runs a block on a trial's stream."""

    def __init__(self):
        self.states: dict = {}

    def add(self, trial, device: torch.device) -> None:
        """``trial``'s stream starts at the global state now (right after its construction
        seeded it and drew its initial weights, or restored a checkpoint's)."""
        self.states[trial] = _rng_state(device)

    def drop(self, trial) -> None:
        self.states.pop(trial, None)

    @contextlib.contextmanager
    def of(self, trial):
        state = self.states[trial]
        process = _rng_state(state[2])
        _set_rng_state(state)
        try:
            yield
        finally:
            if trial in self.states:  # not dropped meanwhile
                self.states[trial] = _rng_state(state[2])
            _set_rng_state(process)
