"""N trials of one structure stacked on a trial axis: their parts of the eager step
(:class:`StackedTrials`, the :class:`~mtbert.step.step_engine.TrialParts` of
:class:`~mtbert.step.step_engine.EagerStep` for N >= 2).

The trials' models are stacked (:class:`~mtbert.step.fused_model.FusedModel`; each trial
model's parameters become views of its slice) and trained by one per-trial AdamW
(:class:`~mtbert.techniques.trial_adamw.TrialAdamW`) whose moments each trial's own optimizer
holds as views too, so that each trial's evaluation, checkpoint and predictions read the
stacked state.  Per-trial values are ``[N]`` (or ``[G, N]``) device tensors: learning rate,
weight decay, clipping norm, the loss weights (:func:`mtbert.techniques.losses.stack_combiners`),
dropout, SMART's values (:meth:`mtbert.techniques.smart.SmartRegulariser.stacked`).  Trials whose
schedules differ may train different tasks in the same step: every task in the union runs;
a trial without that task gets filler rows, its loss is multiplied by 0 and its update
masked out where its own tasks did not reach.  Each trial's random draws (its masks'
seed, SMART's noise, PCGrad's task orders) come from its own generator
(``TrialRun.generator``, :mod:`mtbert.core.trial_streams`), in the order its solo run
draws them; its dropout masks are its own (the group's
:class:`~mtbert.core.trial_streams.MaskStream`, one hash over the stacked batch).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from mtbert.core.devices import to_device
from mtbert.core.tasks import TASK_NAMES
from mtbert.core.trial_streams import MaskStream
from mtbert.techniques.trial_adamw import STATE_KEYS, TrialAdamW
from mtbert.techniques.trial_update import TrialUpdate
from mtbert.step.fused_model import FusedModel, stack_batches
from mtbert.step.step_engine import reached_parameters
from mtbert.techniques.gradients import random_orders, trial_orders
from mtbert.techniques.losses import stack_combiners, weight_penalty
from mtbert.techniques.smart import SmartRegulariser

if TYPE_CHECKING:
    from mtbert.run.trial_run import Batches, TrialRun

#: the prefix of a loss combiner's parameters among the stacked trials' trained tensors
LOSS_WEIGHTING = "loss_weighting."


def combiner_parameters(combiner: torch.nn.Module) -> dict[str, torch.nn.Parameter]:
    """A loss combiner's parameters (uncertainty's s_t), named as :class:`StackedTrials`
    names them among its trained tensors."""
    return {LOSS_WEIGHTING + k: p for k, p in combiner.named_parameters()}


class StackedTrials:
    """N trials' parts of the eager step, on their stacked weights (see the module doc).
    Built from the trials' state as it is (fresh, resumed, or views of an earlier stack's,
    which this one copies)."""

    def __init__(self, trials: list[TrialRun]):
        self.trials = list(trials)
        self.slot = {trial: n for n, trial in enumerate(self.trials)}
        first = self.trials[0]
        self.cfg, self.device, self.n = first.cfg, first.device, len(self.trials)
        self.pad_id = first.data.pad_id
        self.autocast = first.autocast
        self.grad_combiner = first.grad_combiner  # one structure: one kind for all
        models = [t.model for t in self.trials]
        self.generators = [t.generator for t in self.trials]  # by slot
        #: the trials' dropout masks, each trial's seeded from its own stream
        self.mask_stream = MaskStream(self.n, self.device)
        self.fused = FusedModel(models, [t.cfg.dropout for t in self.trials], self.cfg.dropout,
                                self.mask_stream)
        self.fused.bind(models)
        self.smart = (SmartRegulariser.stacked(self.fused, [t.regulariser for t in self.trials],
                                               self.generators, self.cfg)
                      if first.regulariser is not None else None)
        shared = {id(p) for p in self.fused.skeleton.shared_parameters()}
        #: the stacked encoder parameters the gradient combiner sees as shared
        self.shared = [self.fused.params[k] for k, p in self.fused.skeleton.named_parameters()
                       if id(p) in shared]
        #: the trials' loss weighting over the trial axis
        self.weighting = stack_combiners([t.loss_combiner for t in self.trials], self.device)
        #: name -> every stacked leaf the per-trial AdamW trains (the models', the loss weights')
        self.trained = {**self.fused.params, **combiner_parameters(self.weighting)}
        #: whether the L1/L2 penalty is on (then it reaches its parameters in every trial)
        self.penalised = bool(self.fused.penalised) and bool(self.weighting.l1
                                                               or self.weighting.l2)
        self._build_optimizer()
        self.reach: dict[str, set[str]] = {}  # task -> names of the parameters its loss reaches
        self._mask_cache: dict[tuple, dict[str, torch.Tensor]] = {}
        self._pattern_cache: dict[tuple, dict] = {}
        # this step's inputs (:meth:`begin`): slot -> host batches; its pattern; task ->
        # stacked device batch; PCGrad's task orders
        self.stepping: dict[int, Batches] = {}
        self.pattern: dict = {}
        self.batches: dict[str, dict[str, torch.Tensor]] = {}
        self.orders = None

    def _build_optimizer(self) -> None:
        """The per-trial AdamW over the stacked parameters, its groups those of the trials'
        own optimizers (named alike in every trial); each trial's optimizer then holds views
        of its slices of the moments and step counts (the state it held is taken in first)."""
        def trial_parameters(trial):
            return {**dict(trial.model.named_parameters()),
                    **combiner_parameters(trial.loss_combiner)}

        first = self.trials[0]
        ids = {id(p): name for name, p in trial_parameters(first).items()}
        group_of = {ids[id(p)]: g for g, group in enumerate(first.optimizer.param_groups)
                    for p in group["params"] if id(p) in ids}
        if len(group_of) != len(self.trained):
            raise ValueError("a fused trial's optimizer holds parameters outside its model "
                             "and loss weighting")
        self.group_of = group_of
        self.optimizer = TrialAdamW({k: self.trained[k] for k in group_of}, group_of,
                                    self._per_group("weight_decay"))
        # per-trial values the update reads, on the device: [G, N] rates, [N] clip norms
        self.lrs = torch.zeros(len(first.optimizer.param_groups), self.n, dtype=torch.float64,
                               device=self.device)
        self.max_norms = torch.tensor([float(t.cfg.max_grad_norm) for t in self.trials],
                                      dtype=torch.float64, device=self.device)
        #: the update over the trial axis, its SMART teachers following the stacked weights
        self.updater = TrialUpdate(self.optimizer, self.max_norms, self.smart, self.fused.params)
        for n, trial in enumerate(self.trials):
            own = trial_parameters(trial)
            for name, state in self.optimizer.state.items():
                held = trial.optimizer.state.get(own[name])
                if held:  # resumed, or from an earlier stack: its state goes in
                    for key in STATE_KEYS:
                        state[key][n].copy_(held[key])
                trial.optimizer.state[own[name]] = {key: state[key][n] for key in STATE_KEYS}
        for trial in self.trials:
            # its LR schedule steps while its own optimizer never does (the per-trial one
            # steps for it): torch's warning about that order does not apply
            trial.optimizer._opt_called = True

    def _per_group(self, key: str) -> list[list[float]]:
        """``[G][N]``: each trial's ``key`` of each of its optimizer's groups (its LR
        schedule writes ``lr`` there before every step)."""
        return [[float(t.optimizer.param_groups[g][key]) for t in self.trials]
                for g in range(len(self.trials[0].optimizer.param_groups))]

    # ------------------------------------------------------------------ the step's parts
    def begin(self, batches: dict[TrialRun, Batches]) -> list[str]:
        """The trials in ``batches`` step (the others do not move).  Every host value the
        step reads goes to the device here, before its first op (what a captured step
        takes as its inputs): which trials step which tasks, each task's stacked batch,
        the rates the trials' LR schedules wrote, each stepping trial's draws (its masks'
        seed, SMART's noise, then PCGrad's task orders, in the order its solo run draws
        them)."""
        self.stepping = {self.slot[t]: b for t, b in batches.items()}
        self.mask_stream.draw({n: self.generators[n] for n in self.stepping})
        self.pattern = self._pattern(self.stepping)
        tasks = [t for t in TASK_NAMES if any(t in b for b in self.stepping.values())]
        self.batches = {
            task: to_device(stack_batches([self.stepping.get(n, {}).get(task)
                                           for n in range(self.n)], self.pad_id), self.device)
            for task in tasks}
        self.lrs.copy_(torch.tensor(self._per_group("lr"), dtype=torch.float64))
        if self.smart is not None:
            self.smart.draw_noise(self.stepping, self.batches)
        self.orders = self._pcgrad_orders(tasks) if self.cfg.pcgrad else None
        return tasks

    def task_loss(self, task: str) -> tuple[torch.Tensor, torch.Tensor]:
        """``[N]`` losses of ``task`` (filler rows where a trial has none); the weighted
        ones of the trials stepping ``task``, summed."""
        self.mask_stream.start(task)
        with torch.autocast(self.device.type, dtype=torch.bfloat16, enabled=self.autocast):
            batch = self.batches[task]
            per_trial = (self.smart.task_losses(task, batch) if self.smart is not None
                         else self.fused.task_losses(task, batch, self.cfg))
            weighted = self.weighting.weighted({task: per_trial})[task]
            if task not in self.reach:
                reached = reached_parameters(weighted)
                self.reach[task] = {k for k, p in self.trained.items() if id(p) in reached}
            present = self.pattern["present"][task]
            return per_trial, (weighted * present.to(weighted.dtype)).sum()

    def penalty(self) -> torch.Tensor | None:
        with torch.autocast(self.device.type, dtype=torch.bfloat16, enabled=self.autocast):
            penalty = weight_penalty([self.fused.params[k] for k in self.fused.penalised],
                                     self.weighting.l1, self.weighting.l2, trial_axis=True)
            if penalty is None:
                return None
            return (penalty * self.pattern["stepping"].to(penalty.dtype)).sum()

    def backward(self, terms: dict[str, torch.Tensor], penalty: torch.Tensor | None) -> None:
        self.grad_combiner.backward(terms, self.shared, penalty, self.orders, trials=self.n)

    def update(self) -> None:
        self.updater.step(self._masks(self.pattern, self.penalised), self.lrs,
                          self.pattern["stepping"])
        self.updater.clear()
        self.stepping, self.batches, self.orders = {}, {}, None

    def losses_of(self, losses, batches):
        slices = {t: loss.unbind(0) for t, loss in losses.items()}  # one op a task, any N
        return {trial: {t: slices[t][self.slot[trial]] for t in trial_batches}
                for trial, trial_batches in batches.items()}

    # ------------------------------------------------------------------ helpers
    def _pcgrad_orders(self, tasks: list[str]):
        """Each trial's PCGrad task orders over its own tasks in the step (``tasks``: the
        step's, in the order of its losses), drawn from its own stream as its solo run
        draws them (:func:`mtbert.techniques.gradients.trial_orders`)."""
        def draw(n: int, count: int) -> list[list[int]]:
            return random_orders(count, self.generators[n])

        return trial_orders(tasks, [list(self.stepping[n]) if n in self.stepping
                                    else None for n in range(self.n)], draw, self.device)

    def _pattern(self, stepping: dict[int, dict]) -> dict:
        """Which trials step which tasks, as device tensors made once per pattern (the
        patterns are few: the schedules' task sets): ``present`` task -> ``[N]`` bool,
        ``stepping`` ``[N]`` bool, ``key`` the pattern."""
        key = tuple(frozenset(stepping[n]) if n in stepping else None for n in range(self.n))
        if key not in self._pattern_cache:
            self._pattern_cache[key] = {
                "key": key,
                "present": {t: torch.tensor([k is not None and t in k for k in key],
                                            device=self.device) for t in TASK_NAMES},
                "stepping": torch.tensor([k is not None for k in key], device=self.device)}
        return self._pattern_cache[key]

    def _masks(self, pattern: dict, penalty: bool) -> dict[str, torch.Tensor]:
        """name -> ``[N]`` 0/1 on the device: the trials whose step reached the parameter
        (their own tasks' losses, and the L1/L2 penalty's parameters in every stepping
        trial); made once per pattern."""
        key = (penalty, pattern["key"])
        if key not in self._mask_cache:
            penalised = set(self.fused.penalised) if penalty else set()
            reached = [set().union(*(self.reach[t] for t in tasks)) | penalised
                       if tasks is not None else set() for tasks in pattern["key"]]
            self._mask_cache[key] = {
                name: torch.tensor([float(name in reached[n]) for n in range(self.n)],
                                   device=self.device) for name in self.trained}
        return self._mask_cache[key]
