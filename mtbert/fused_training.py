"""Train N configurations at once: those of one structure fused into one model.

:func:`train_fused` groups the configurations by :func:`fuse_key` (what the fused step is
built from: the model and its heads, the pair encoding, the losses and the gradient
combiner, each task's batch size, the data); each group of two or more that can fuse
trains as one :class:`FusedGroup`, every other configuration alone with the
:class:`~mtbert.trainer.Trainer` (:func:`unfusable` says why, in one line).

A :class:`FusedGroup` builds one :class:`~mtbert.trainer.Trainer` per trial, as its solo
run builds it (initial weights from its seed, pre-training, batchers, schedule, LR
schedule, optimizer), so each trial keeps everything a solo run has: its batches in its
order, its evaluations, history, checkpoints and predictions, written by its own
trainer into its own folder (the same files as a solo run's; a checkpoint resumes solo).
Only the step is shared: the trials' models are stacked (:mod:`mtbert.fused_model`; each
trial model's parameters become views of its slice) and one fused step trains them all,
with a per-trial AdamW (:mod:`mtbert.fused_adamw`) whose moments each trial's optimizer
holds as views too, so a trial's checkpoint holds its own optimizer state.

Each trial advances one optimizer step per fused step.  Trials whose schedules differ may
train different tasks in the same step: the fused step runs every task in the union;
a trial without that task gets filler rows, its loss is multiplied by 0 and its update
masked out where its own tasks did not reach (``TrialAdamW``).  A trial that ends (its
budget, a non-finite loss) leaves the others going; its slices no longer step.

Per-trial values as ``[N]`` (or ``[G, N]``) tensors: learning rate and its schedule,
weight decay, clipping norm, the loss weights -- fixed, or uncertainty's learned s_t
trained by the fused AdamW (:mod:`mtbert.fused_losses`) --, dropout, SMART's λ_t, ε, μ,
β, noise and ascent step (:mod:`mtbert.fused_smart`; each trial draws SMART's noise from
its own random stream, on which its evaluations and checkpoints run too), and PCGrad's
task orders, drawn from that stream (:mod:`mtbert.fused_gradients`: one backward per task,
the projection batched over the trials).  Not fused yet: ``torch.compile`` and CUDA graphs
of the fused step (the fused step is eager; on CUDA the trials train with
``step_mode=eager``), and encoders other than BERT's.
"""

from __future__ import annotations

import time
from pathlib import Path

import torch

from mtbert import graph_reuse
from mtbert.config import DATA_PER_SEARCH, FUSED_PER_TRIAL, TrainConfig
from mtbert.data import MultitaskData, real_rows
from mtbert.fused_adamw import TrialAdamW
from mtbert.fused_gradients import FusedPCGrad
from mtbert.fused_losses import FusedLossWeighting, combiner_parameters
from mtbert.fused_model import FUSABLE_MODEL_TYPES, FusedModel, stack_batches
from mtbert.fused_smart import FusedSmart, TrialStreams
from mtbert.pretrained import load_model_config
from mtbert.step_graphs import reached_parameters
from mtbert.tasks import TASK_NAMES
from mtbert.trainer import NonFiniteLossError, Trainer


def fuse_key(cfg: TrainConfig) -> tuple:
    """Trials with equal keys train as one fused model: the step's structure
    (:func:`mtbert.graph_reuse.structure`, less :data:`~mtbert.config.FUSED_PER_TRIAL`: the
    fixed loss weights), each task's batch size and the settings that shape the data (one
    ``MultitaskData`` serves the group: :data:`~mtbert.config.DATA_PER_SEARCH`)."""
    structure = tuple(item for item in graph_reuse.structure(cfg)
                      if item[0] not in FUSED_PER_TRIAL)
    data = tuple(sorted((k, v) for k, v in cfg.to_dict().items() if k in DATA_PER_SEARCH))
    return structure + (("task_batch_sizes", tuple(cfg.task_batch_size(t) for t in TASK_NAMES)),
                        ("data", data))


def unfusable(cfg: TrainConfig) -> str | None:
    """Why ``cfg`` trains alone (one line), or None when it can fuse."""
    if cfg.compile != "none":
        return f"compile={cfg.compile}: torch.compile of the fused step is not built"
    if cfg.step_mode == "graphs":
        return "step_mode=graphs: the fused step runs eagerly (no fused CUDA graphs yet)"
    model_type = getattr(load_model_config(cfg.model), "model_type", None)
    if model_type not in FUSABLE_MODEL_TYPES:
        return (f"model_type {model_type!r}: the fused step is built for "
                f"{', '.join(FUSABLE_MODEL_TYPES)} encoders")
    return None


def plan_groups(cfgs: list[TrainConfig]) -> list[tuple[list[int], str | None]]:
    """(indices of the configurations, why they train alone or None) per group, in the
    order of their first configuration: a fusable structure's configurations together, an
    unfusable one's each alone."""
    groups: dict[tuple, list[int]] = {}
    reasons: dict[int, str] = {}
    for i, cfg in enumerate(cfgs):
        reason = unfusable(cfg)
        if reason is not None:
            reasons[i] = reason
            groups[("alone", i)] = [i]
        else:
            groups.setdefault(fuse_key(cfg), []).append(i)
    return [(members, reasons.get(members[0])) for members in groups.values()]


def eager(cfg: TrainConfig) -> TrainConfig:
    """The trial's config as its fused run trains it: the step is eager."""
    return cfg if cfg.step_mode == "eager" else cfg.replace(step_mode="eager")


class FusedGroup:
    """N trials of one structure trained as one model (see the module doc).  ``models``:
    each trial's initial model (default: built by its trainer from its seed, as solo);
    ``trainer_options``: passed to every :class:`Trainer` (``report``, ``checkpoints``)."""

    def __init__(self, cfgs: list[TrainConfig], data: MultitaskData, out_dirs: list[str | Path],
                 models: list | None = None, **trainer_options):
        keys = {fuse_key(c) for c in cfgs}
        if len(keys) != 1:
            raise ValueError("a fused group's configurations must share one structure "
                             "(fuse_key)")
        self.trainers, self.streams = [], None
        for i, (cfg, out) in enumerate(zip(cfgs, out_dirs)):
            self.trainers.append(Trainer(eager(cfg), data, out, model=None if models is None
                                         else models[i], **trainer_options))
            self.streams = self.streams or TrialStreams(self.trainers[0].device)
            self.streams.add()  # the trial's own random stream, as its solo run's
        first = self.trainers[0]
        self.cfg, self.device, self.n = first.cfg, first.device, len(cfgs)
        self.pad_id = data.pad_id
        models = [t.model for t in self.trainers]
        self.fused = FusedModel(models, [t.cfg.dropout for t in self.trainers], self.cfg.dropout)
        self.fused.bind(models)
        self.smart = (FusedSmart(self.fused, [t.regulariser for t in self.trainers],
                                 self.streams, self.cfg)
                      if first.regulariser is not None else None)
        shared = {id(p) for p in self.fused.skeleton.shared_parameters()}
        self.pcgrad = (FusedPCGrad([self.fused.params[k] for k, p in
                                    self.fused.skeleton.named_parameters() if id(p) in shared],
                                   self.streams)
                       if self.cfg.pcgrad else None)
        self.weighting = FusedLossWeighting([t.loss_combiner for t in self.trainers],
                                            self.device)
        #: name -> every stacked leaf the fused AdamW trains (the models', the loss weights')
        self.trained = {**self.fused.params, **self.weighting.params}
        self._build_optimizer()
        self.reach: dict[str, set[str]] = {}  # task -> names of the parameters its loss reaches
        self._mask_cache: dict[tuple, dict[str, list[bool]]] = {}
        self.timings = {"steps": 0, "step_s": 0.0}

    def _build_optimizer(self) -> None:
        """The per-trial AdamW over the stacked parameters, its groups those of the trials'
        own optimizers (named alike in every trial); each trial's optimizer then holds views
        of its slices of the moments and step counts (a restored state is taken in first)."""
        def trial_parameters(trainer):
            return {**dict(trainer.model.named_parameters()),
                    **combiner_parameters(trainer.loss_combiner)}

        first = self.trainers[0]
        ids = {id(p): name for name, p in trial_parameters(first).items()}
        group_of = {ids[id(p)]: g for g, group in enumerate(first.optimizer.param_groups)
                    for p in group["params"] if id(p) in ids}
        if len(group_of) != len(self.trained):
            raise ValueError("a fused trial's optimizer holds parameters outside its model "
                             "and loss weighting")
        self.group_of = group_of
        self.optimizer = TrialAdamW({k: self.trained[k] for k in group_of}, group_of)
        self.weight_decays = self._per_group("weight_decay")
        for n, trainer in enumerate(self.trainers):
            own = trial_parameters(trainer)
            for name, state in self.optimizer.state.items():
                held = trainer.optimizer.state.get(own[name])
                if held:  # resumed: its solo state goes into the stacked one
                    for key in ("step", "exp_avg", "exp_avg_sq"):
                        state[key][n].copy_(held[key])
                trainer.optimizer.state[own[name]] = {key: state[key][n] for key in
                                                      ("step", "exp_avg", "exp_avg_sq")}
        for trainer in self.trainers:
            # its LR schedule steps while its own optimizer never does (the fused one steps
            # for it): torch's warning about that order does not apply
            trainer.optimizer._opt_called = True

    def _per_group(self, key: str) -> list[list[float]]:
        """``[G][N]``: each trial's ``key`` of each of its optimizer's groups (its LR
        schedule writes ``lr`` there before every step)."""
        return [[float(t.optimizer.param_groups[g][key]) for t in self.trainers]
                for g in range(len(self.trainers[0].optimizer.param_groups))]

    # ------------------------------------------------------------------ training
    def fit(self) -> list[dict | BaseException]:
        """Train every trial to its end; returns each one's final metrics (as
        :meth:`Trainer.fit` does), or the error that stopped it (a non-finite loss)."""
        results: list[dict | BaseException | None] = [None] * self.n
        steps = []
        for n, trainer in enumerate(self.trainers):
            trainer._start = time.perf_counter()
            trainer._examples_at_start = trainer.examples_seen
            trainer.log(f"[mtbert] device={self.device} step=fused ({self.n} trials) "
                        f"schedule={trainer.cfg.schedule} update={trainer.cfg.update} "
                        f"optimizer steps≈{trainer.total_steps}")
            if (trainer.cfg.eval_at_start and trainer.evaluations == 0
                    and trainer.examples_seen == 0):
                with self.streams.of(n):
                    trainer._evaluate_and_report()
            steps.append(self._trial_steps(trainer))
        active = list(range(self.n))
        try:
            while active:
                batches = {}
                for n in list(active):
                    try:
                        with self.streams.of(n):  # its evaluations, checkpoints
                            batches[n] = next(steps[n])
                    except StopIteration:
                        active.remove(n)
                        with self.streams.of(n):
                            results[n] = self.trainers[n].finish()
                    except NonFiniteLossError as exc:
                        active.remove(n)
                        self.trainers[n].checkpoint_writer.close()
                        results[n] = exc
                if batches:
                    self.step(batches)
        finally:
            for trainer in self.trainers:
                trainer.checkpoint_writer.close()
        return results

    @staticmethod
    def _trial_steps(trainer: Trainer):
        """One trial's optimizer steps ({task: host batch} each), in its solo order; its
        schedule's bookkeeping (evaluations, budget) runs between them."""
        for group in trainer.schedule_steps():
            batches = trainer.next_batches(group)
            yield from trainer.update_steps(batches)
            trainer.examples_seen += sum(real_rows(b) for b in batches.values())

    def step(self, batches: dict[int, dict[str, dict[str, torch.Tensor]]]) -> None:
        """One fused optimizer step: trial n (a key of ``batches``) trains on its
        ``batches[n]`` ({task: host batch}); the others do not move."""
        started = time.perf_counter()
        tasks = [t for t in TASK_NAMES if any(t in b for b in batches.values())]
        present = {t: torch.tensor([n in batches and t in batches[n] for n in range(self.n)],
                                   device=self.device) for t in tasks}
        stepping = torch.tensor([n in batches for n in range(self.n)], device=self.device)
        losses, summed = {}, {}  # task -> [N] losses; its weighted loss summed over trials
        if self.smart is not None:
            self.smart.draw_noise(batches)
        with torch.autocast(self.device.type, dtype=torch.bfloat16,
                            enabled=self.trainers[0].autocast):
            for task in tasks:
                host = stack_batches([batches.get(n, {}).get(task) for n in range(self.n)],
                                     self.pad_id)
                host = self.trainers[0]._to_device(host)
                per_trial = (self.smart.task_losses(task, host) if self.smart is not None
                             else self.fused.task_losses(task, host, self.cfg))
                if task not in self.reach:
                    reached = reached_parameters(per_trial)
                    self.reach[task] = ({k for k, p in self.fused.params.items()
                                         if id(p) in reached} | self.weighting.reached(task))
                losses[task] = per_trial
                weighted = self.weighting.weighted(task, per_trial)
                summed[task] = (weighted * present[task].to(weighted.dtype)).sum()
            penalty = self.fused.penalty(self.cfg.l1_lambda, self.cfg.l2_lambda)
            extra = None if penalty is None else (penalty * stepping.to(penalty.dtype)).sum()
        if self.pcgrad is not None:
            self.pcgrad.backward(summed, extra, batches)
        else:
            (sum(summed.values()) + (0.0 if extra is None else extra)).backward()
        masks = self._masks(batches, penalty is not None)
        self._clip(masks)
        lrs = self._per_group("lr")
        self.optimizer.step(lrs, self.weight_decays, masks)
        if self.smart is not None:
            self.smart.after_step(list(batches))
        # zeroed in place, not dropped: the gradients stay the same tensors (the optimizer's
        # views of them too); which slices step is the masks' business
        torch._foreach_zero_([p.grad for p in self.trained.values() if p.grad is not None])
        for n, trial_batches in batches.items():
            trainer = self.trainers[n]
            trainer._note_losses({t: losses[t][n] for t in trial_batches})
            trainer.lr_scheduler.step()
            trainer.optimizer_steps += 1
        self.timings["steps"] += 1
        self.timings["step_s"] += time.perf_counter() - started

    def _masks(self, batches: dict[int, dict], penalty: bool) -> dict[str, list[bool]]:
        """name -> N booleans: the trials whose step reached the parameter (their own
        tasks' losses, and the L1/L2 penalty's parameters in every stepping trial)."""
        key = (penalty, tuple(frozenset(batches[n]) if n in batches else None
                              for n in range(self.n)))
        if key not in self._mask_cache:
            penalised = set(self.fused.penalised) if penalty else set()
            reached = [set().union(*(self.reach[t] for t in batches[n])) | penalised
                       if n in batches else set() for n in range(self.n)]
            self._mask_cache[key] = {name: [name in reached[n] for n in range(self.n)]
                                     for name in self.trained}
        return self._mask_cache[key]

    def _clip(self, masks: dict[str, list[bool]]) -> None:
        """Each trial's gradient scaled to its ``max_grad_norm`` (0: not clipped):
        ``torch.nn.utils.clip_grad_norm_``'s arithmetic on the gradients its step reached, in
        its solo optimizer's order (so the same to the last bit, float32 loss weights too)."""
        for n, trainer in enumerate(self.trainers):
            max_norm = trainer.cfg.max_grad_norm
            grads = [p.grad[n] for name, p in self.optimizer.params.items()
                     if p.grad is not None and masks[name][n]] if max_norm else []
            if grads:
                total = torch.nn.utils.get_total_norm(grads)
                torch._foreach_mul_(grads, torch.clamp(max_norm / (total + 1e-6), max=1.0))


def train_fused(cfgs: list[TrainConfig], data: MultitaskData, out_dirs: list[str | Path],
                log=print) -> list[dict | BaseException]:
    """Train every configuration into its folder (``out_dirs[i]``, the files of a solo
    run): each fusable structure's configurations as one :class:`FusedGroup`, the others
    alone (the reason logged).  Returns each one's final metrics or the error that stopped
    it, in the order of ``cfgs``."""
    results: list[dict | BaseException | None] = [None] * len(cfgs)
    for members, reason in plan_groups(cfgs):
        if reason is not None or len(members) == 1:
            i = members[0]
            if reason is not None:
                log(f"[mtbert] {out_dirs[i]}: trains alone: {reason}")
            try:
                results[i] = Trainer(cfgs[i], data, out_dirs[i]).fit()
            except NonFiniteLossError as exc:
                results[i] = exc
            continue
        log(f"[mtbert] {len(members)} trials fused: {', '.join(str(out_dirs[i]) for i in members)}")
        group = FusedGroup([cfgs[i] for i in members], data, [out_dirs[i] for i in members])
        for i, result in zip(members, group.fit()):
            results[i] = result
    return results
