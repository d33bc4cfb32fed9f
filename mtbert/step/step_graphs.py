"""Captured CUDA graphs of the training step (``step_mode=graphs``).

An eager step launches several hundred small kernels from Python, ~30 µs of host time
each (dispatcher, autograd, autocast), and SMART triples that: on a GPU the host, not
the GPU, sets the pace of a MiniLM step of 32 rows.  Here each part of the step is
captured once into a CUDA graph and then replayed with one launch:

* a **task graph** per (task, batch shapes): bf16 autocast (its weight-cast cache off,
  so the casts are captured too), forward, task loss, SMART term, loss weighting and
  backward, accumulating into static ``.grad`` buffers.  Fixed batch shapes make the
  graphs few: a fixed row count per task (filler rows of weight 0) and a few static
  lengths (``data.STATIC_LENGTHS``), so 3 tasks x 3 lengths at ``max_length`` 128;
* an **optimizer graph** per set of tasks in a step: the L1/L2 penalty's backward,
  gradient clipping, fused AdamW (``capturable``, the learning rates read from a device
  vector that the LR schedule writes before each step), the SMART teacher's EMA, and the
  zeroing of the gradients.  Only the parameters the step's losses reach are updated, as
  in the eager step, where the others have no gradient.

Warm-up: the first ``warmup_steps`` steps of each graph run eagerly on the graphs' side
stream (lazy initialisations: cuBLAS workspaces, the optimizer's state) as real training
steps, then the graph is captured at the end of that step and replayed from the next on.
The eager steps compute the same step with the same random numbers, so nothing is thrown
away and a resumed run (which warms up again) trains as the uninterrupted one.

Random numbers.  SMART's noise draws from the trial's generator
(:mod:`mtbert.core.trial_streams`), registered with each task graph, whose graph-safe state
gives each replay fresh numbers (PyTorch advances its philox offset by the graph's whole
increment per replay).  The dropout masks hash the trial's step seed, drawn before the
step's graphs run into a tensor they read, with each draw's place, a constant of the graph:
each replay drops anew, and SMART's forwards replay the clean forward's masks by setting
the place back during the capture, as eagerly (:class:`mtbert.core.trial_streams.MaskStream`).
(Not yet run on a GPU since the trial's masks became a hash.)

All graphs share one memory pool: they never run at once, and what outlives a replay
(the task losses, the gradients, the static inputs) is kept alive or allocated outside.
"""

from __future__ import annotations

import contextlib
import time
from dataclasses import dataclass, field

import torch
from torch import nn

from mtbert.step.step_engine import reached_parameters, task_loss_terms

#: eager steps of a graph's structure before it is captured
WARMUP_STEPS = 2


def batch_shapes(batch: dict[str, torch.Tensor]) -> tuple:
    """The shapes and dtypes of a batch's tensors: a task graph serves batches alike."""
    return tuple((k, tuple(v.shape), v.dtype) for k, v in sorted(batch.items()))


@dataclass
class TaskGraph:
    graph: torch.cuda.CUDAGraph
    inputs: dict[str, torch.Tensor]
    loss: torch.Tensor


@dataclass
class GraphStats:
    """What the graphs cost and did (reported by the trainer and the benches)."""
    shapes: set = field(default_factory=set)  # (task, batch shapes) met
    captured: int = 0
    task_graphs_captured: int = 0  # of ``captured``; the others are optimizer graphs
    kept: int = 0  # task graphs taken from the worker's previous trial
    capture_s: float = 0.0
    eager_steps: int = 0
    replayed_steps: int = 0

    def as_metrics(self) -> dict:
        return {"graphs/shapes": len(self.shapes), "graphs/captured": self.captured,
                "graphs/kept": self.kept,
                "graphs/capture_s": self.capture_s, "graphs/eager_steps": self.eager_steps,
                "graphs/replayed_steps": self.replayed_steps}


class StepGraphs:
    """One training step (``step({task: host batch}) -> {task: loss}``) from captured
    graphs; the trainer's model, optimizer, loss combiner and regulariser are used as they
    are (see the module doc)."""

    def __init__(self, trainer, warmup_steps: int = WARMUP_STEPS, log=print,
                 kept: "StepGraphs | None" = None):
        """On a CPU nothing is captured: every step runs the graphs' bodies eagerly (so the
        bookkeeping around them -- fixed batches, reached parameters, static gradients,
        tensor learning rates -- is tested where CI runs).  ``kept``: the step graphs of this
        worker's previous trainer of the same structure, whose task graphs (and the
        trainer's model, loss weighting and regulariser they read) this one replays
        (:mod:`mtbert.loop.graph_reuse`); its optimizer graphs are captured anew."""
        self.t = trainer
        self.device = trainer.device
        self.cuda = self.device.type == "cuda"
        self.warmup_steps = warmup_steps if self.cuda else float("inf")
        self.log = log
        self.stats = GraphStats()
        if kept is not None:
            self._adopt(kept)
        else:
            self.stream = torch.cuda.Stream(self.device) if self.cuda else None
            self.pool = torch.cuda.graph_pool_handle() if self.cuda else None
            #: the generator the task graphs register (the trial's stream)
            self.generator = trainer.generator if self.cuda else None
            self.task_graphs: dict[tuple, TaskGraph] = {}
            self.reach: dict[str, set[int]] = {}
            self.static_grads = False
        self.params = [p for g in trainer.optimizer.param_groups for p in g["params"]]
        # the LR schedule keeps float learning rates in the param groups; the update reads
        # these device copies (one vector, written before every step)
        groups = trainer.optimizer.param_groups
        self.lr_vector = torch.tensor([float(g["lr"]) for g in groups], device=self.device,
                                      dtype=torch.float32)
        self.lr_views = [self.lr_vector[i] for i in range(len(groups))]
        for group in groups:
            group["capturable"] = True
        self.optimizer_graphs: dict[frozenset, torch.cuda.CUDAGraph] = {}
        self.eager_counts: dict = {}
        self.last_batch: dict[tuple, dict[str, torch.Tensor]] = {}

    def _adopt(self, kept: "StepGraphs") -> None:
        """The kept task graphs with their stream, memory pool, generator and the
        parameters each task's loss reaches; the static gradients zeroed (a stop between a
        task graph and the update may have left a sum in them)."""
        self.stream, self.pool, self.generator = kept.stream, kept.pool, kept.generator
        if self.generator is not None:  # the graphs draw from the generator they registered:
            self._draw_on(self.generator)  # it takes this trial's stream
        self.task_graphs, self.reach = kept.task_graphs, kept.reach
        self.static_grads = kept.static_grads
        if self.static_grads:
            torch._foreach_zero_([p.grad for p in kept.params if p.grad is not None])
        else:
            for p in kept.params:
                p.grad = None
        self.stats.kept = len(self.task_graphs)
        if self.task_graphs:
            self.log(f"[mtbert] step graphs: {len(self.task_graphs)} task graphs kept from "
                     "this worker's previous trial of the same structure")

    def _draw_on(self, generator: torch.Generator) -> None:
        """The trainer's stream goes on in ``generator`` (its state taken in), which its
        masks' seeds and its regulariser then draw from."""
        t = self.t
        generator.set_state(t.generator.get_state())
        t.generator = generator
        if t.regulariser is not None:
            t.regulariser.draw_from(generator)

    def release(self) -> None:
        """Let go of the trainer and its optimizer graphs (what a kept step does not
        carry to the next trainer, whose optimizer is new): the trainer, its optimizer
        state and its host buffers can then be freed.  No step runs after this."""
        self.t = self.log = None
        self.optimizer_graphs.clear()
        self.eager_counts.clear()
        self.last_batch.clear()

    # ------------------------------------------------------------------ a step
    def step(self, batches: dict) -> dict:
        """The engine's step (:mod:`mtbert.step.step_engine`): ``{trial: host batches}`` of its
        one trial -> ``{trial: {task: loss}}``."""
        (trial, host), = batches.items()
        return {trial: self.train(host)}

    def train(self, batches: dict[str, dict[str, torch.Tensor]]) -> dict[str, torch.Tensor]:
        """One optimizer step on host ``batches`` ({task: batch}); returns each task's loss
        (device tensors of their own)."""
        with self._side_stream():
            losses, ready = {}, []
            self.t.mask_stream.draw({0: self.t.generator})  # read by the task graphs
            for task, batch in batches.items():
                key = (task, batch_shapes(batch))
                self.stats.shapes.add(key)
                graph = self.task_graphs.get(key)
                if graph is None:
                    losses[task] = self._eager_task(task, batch)
                    self.last_batch[key] = batch
                    if self._count(key) >= self.warmup_steps:
                        ready.append(key)
                else:
                    self._replay_task(graph, batch)
                    losses[task] = graph.loss.clone()
            tasks = frozenset(batches)
            self._write_lrs()
            optimizer_graph = self.optimizer_graphs.get(tasks)
            if optimizer_graph is None:
                self._update(tasks)
                self.stats.eager_steps += 1
                if self._count(tasks) >= self.warmup_steps:
                    ready.append(tasks)
            else:
                optimizer_graph.replay()
                self.stats.replayed_steps += 1
            for key in ready:
                self._capture(key)
        return losses

    @contextlib.contextmanager
    def _side_stream(self):
        """Eager warm-up and capture on a side stream (as CUDA graphs ask), ordered after and
        before the default stream's work."""
        if not self.cuda:
            yield
            return
        self.stream.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(self.stream):
            yield
        torch.cuda.current_stream(self.device).wait_stream(self.stream)

    def _count(self, key) -> int:
        self.eager_counts[key] = self.eager_counts.get(key, 0) + 1
        return self.eager_counts[key]

    def _to_device(self, batch: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        if not self.cuda:
            return {k: v.to(self.device) for k, v in batch.items()}
        return {k: v.pin_memory().to(self.device, non_blocking=True) for k, v in batch.items()}

    def _replay_task(self, graph: TaskGraph, batch: dict[str, torch.Tensor]) -> None:
        for key, value in batch.items():
            graph.inputs[key].copy_(value.pin_memory(), non_blocking=True)
        graph.graph.replay()

    def _eager_task(self, task: str, batch: dict[str, torch.Tensor]) -> torch.Tensor:
        loss, weighted = self._task_loss(task, self._to_device(batch))
        self.reach.setdefault(task, set()).update(reached_parameters(weighted))
        weighted.backward()
        return loss

    # ------------------------------------------------------------------ the bodies
    def _task_loss(self, task: str, batch: dict[str, torch.Tensor],
                   ) -> tuple[torch.Tensor, torch.Tensor]:
        """(the task loss as the trainer logs it, the weighted loss to differentiate)."""
        self.t.mask_stream.start(task)
        loss, weighted = task_loss_terms(self.t, task, batch, cast_cache=False)
        return loss.detach().float(), weighted

    def _reached(self, tasks: frozenset) -> list[nn.Parameter]:
        """The parameters a step of ``tasks`` updates: those its task losses reached in
        their eager steps (every task body ran eagerly before its graph, and before the
        update of the same step) and those the L1/L2 penalty reaches."""
        ids = set().union(*(self.reach[t] for t in tasks))
        ids |= set(map(id, self.t.loss_combiner.penalised(self.t.model)))
        return [p for p in self.params if id(p) in ids]

    def _write_lrs(self) -> None:
        lrs = torch.tensor([float(g["lr"]) for g in self.t.optimizer.param_groups],
                           dtype=torch.float32, pin_memory=self.cuda)
        self.lr_vector.copy_(lrs, non_blocking=True)

    @contextlib.contextmanager
    def _only(self, reached: list[nn.Parameter]):
        """The update sees gradients of ``reached`` only (the others are None meanwhile, as
        in an eager step whose losses did not reach them), and the device learning rates."""
        keep = set(map(id, reached))
        parked = {id(p): p.grad for p in self.params if id(p) not in keep}
        groups = self.t.optimizer.param_groups
        floats = [g["lr"] for g in groups]
        for p in self.params:
            if id(p) in parked:
                p.grad = None
        for group, view in zip(groups, self.lr_views):
            group["lr"] = view
        try:
            yield
        finally:
            for p in self.params:
                if id(p) in parked:
                    p.grad = parked[id(p)]
            for group, value in zip(groups, floats):
                group["lr"] = value

    def _update(self, tasks: frozenset) -> None:
        """Penalty backward, clipping, AdamW, the teacher's EMA, zeroed gradients."""
        t = self.t
        reached = self._reached(tasks)
        with self._only(reached):
            penalty = t.loss_combiner.penalty(t.model)
            if penalty is not None:
                penalty.backward()
            with_grad = [p for p in reached if p.grad is not None]
            if t.cfg.max_grad_norm:
                torch.nn.utils.clip_grad_norm_(with_grad, t.cfg.max_grad_norm, foreach=True)
            t.optimizer.step()
            if t.regulariser is not None:
                t.regulariser.after_step(t.model)
            if self.static_grads:
                torch._foreach_zero_([p.grad for p in with_grad])
            else:
                for p in with_grad:
                    p.grad = None

    # ------------------------------------------------------------------ capture
    def allocate_grads(self) -> None:
        """Static gradient buffers (zero; outside the graphs' pool), from the first capture."""
        if not self.static_grads:
            for p in self.params:
                p.grad = torch.zeros_like(p)
            self.static_grads = True

    def _capture(self, key) -> None:
        started = time.perf_counter()
        self.allocate_grads()
        graph = torch.cuda.CUDAGraph()
        if isinstance(key, frozenset):
            with torch.cuda.graph(graph, pool=self.pool, stream=self.stream,
                                  capture_error_mode="thread_local"):
                self._update(key)
            self.optimizer_graphs[key] = graph
            what = "update of " + "+".join(sorted(key))
        else:
            task = key[0]
            inputs = {k: torch.empty(v.shape, dtype=v.dtype, device=self.device)
                      for k, v in self.last_batch.pop(key).items()}
            graph.register_generator_state(self.generator)
            with torch.cuda.graph(graph, pool=self.pool, stream=self.stream,
                                  capture_error_mode="thread_local"):
                loss, weighted = self._task_loss(task, inputs)
                weighted.backward()
            self.task_graphs[key] = TaskGraph(graph, inputs, loss)
            self.stats.task_graphs_captured += 1
            what = f"{task} {[tuple(s) for k, s, _ in key[1] if k.startswith('input_ids')]}"
        seconds = time.perf_counter() - started
        self.stats.captured += 1
        self.stats.capture_s += seconds
        self.log(f"[mtbert] step graph {self.stats.captured}: {what} captured in {seconds:.2f} s "
                 f"(after {self.warmup_steps} eager steps)")


def graphs_wanted(cfg, device: torch.device) -> bool:
    """``step_mode`` resolved: graphs where asked, or under auto on CUDA with compile none,
    no PCGrad and static batch shapes."""
    return eager_reason(cfg, device) is None


def eager_reason(cfg, device: torch.device) -> str | None:
    """Why the step runs eager (for the progress line), or None where it runs from graphs."""
    if cfg.step_mode == "eager":
        return "step_mode=eager"
    if device.type != "cuda":
        return f"no CUDA graphs on {device.type}"
    if cfg.step_mode == "graphs":
        return None
    if cfg.pcgrad:
        return "pcgrad: its per-task backwards move gradients out of .grad"
    if cfg.compile != "none":
        return f"compile={cfg.compile}"
    if cfg.pad_lengths == "batch":
        return "pad_lengths=batch: a new shape every batch"
    return None
