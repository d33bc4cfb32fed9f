"""A CPU trial's torch threads: the CPUs Ray holds for it, plus its share of its node's
CPUs that no one holds and no other process keeps busy (#48).

A running trial's Ray resources change only when it pauses, so a trial whose partners
ended trained on one thread beside idle cores: the main job's second finalist trained
its last ~1,900 examples (192 s) on one of the 2 cores (docs/bench/main_job.md).
:class:`NodeThreadShare` is the Trainer's ``threads_wanted`` hook: every
:data:`CHECK_EVERY_S` it reads the node's free CPUs from Ray's resource view and the
machine's load from ``/proc/stat`` and answers :func:`threads_for`, so the trial grows
into CPUs that free up and shrinks back as soon as another trial's placement group
takes them (before that trial has even imported torch).  The load counts because Ray
knows only its own trials: a torch thread on a core another process keeps busy stalls
every parallel region of the step (on the 2-core machine with other jobs running, a
tiny-model trial on 2 threads trained 7x slower than on 1).  Measured there: the Ray
query takes ~0.5 ms, and Ray's view shows a freed placement group ~60 ms after its
removal.
"""

from __future__ import annotations

import os
import time

#: seconds between two reads of Ray's resource view
CHECK_EVERY_S = 2.0


def threads_for(own_cpus: float, node_cpus: float, free_cpus: float,
                idle_cpus: float | None = None) -> int:
    """Torch threads for a trial holding ``own_cpus`` of a node's ``node_cpus``, of which
    ``free_cpus`` nobody holds: its own CPUs plus the free ones in proportion to what it
    holds among the holders, at most ``idle_cpus`` more than it holds (the machine's CPUs
    that other processes leave idle, beyond the trial's own: None, unknown, caps
    nothing).  Trials that all follow this rule never sum to more threads than the node
    has CPUs; a holder that does not grow (an idle cached worker) only leaves some free
    CPUs unused."""
    held = node_cpus - free_cpus
    base = max(1, int(own_cpus))
    if own_cpus <= 0 or held <= 0 or free_cpus <= 0:
        return base
    share = free_cpus * min(1.0, own_cpus / held)
    threads = max(1, int(own_cpus + share + 1e-9))  # (1e-9: 0.5 + 1.5 is 2, not 1.999...)
    if idle_cpus is not None:
        threads = min(threads, max(base, int(own_cpus + idle_cpus + 1e-9)))
    return threads


def busy_cpu_seconds() -> float | None:
    """CPU-seconds this machine's CPUs have spent busy since boot, from ``/proc/stat``
    (all but idle and iowait time; steal included); None where it cannot be read."""
    try:
        with open("/proc/stat", encoding="ascii") as stat:
            jiffies = [int(x) for x in stat.readline().split()[1:9]]
    except (OSError, ValueError):
        return None
    return (sum(jiffies) - jiffies[3] - jiffies[4]) / os.sysconf("SC_CLK_TCK")


class MachineLoad:
    """The CPUs that processes other than this one kept busy on this machine since the
    last reading, from ``/proc/stat`` (busy: all but idle and iowait time; steal
    included) less this process's CPU time (None where ``/proc/stat`` is missing).  In a
    container it may count the host's other CPUs too: the trial then grows less, never
    more."""

    def __init__(self):
        self._last = self._sample()

    @staticmethod
    def _sample() -> tuple[float, float, float] | None:
        busy = busy_cpu_seconds()
        return None if busy is None else (busy, time.process_time(), time.monotonic())

    def others_busy(self) -> float | None:
        last, self._last = self._last, self._sample()
        if last is None or self._last is None or self._last[2] - last[2] <= 0:
            return None
        busy, ours, wall = (b - a for a, b in zip(last, self._last))
        return max(0.0, (busy - ours) / wall)


class NodeThreadShare:
    """The ``threads_wanted`` hook of a CPU trial on Ray node ``node_id``: asked after
    every step, it reads Ray's view of the node and the machine's load at most every
    ``every_s`` seconds and answers :func:`threads_for`, at most the CPUs this process
    may run on.  Other processes' load counts in whole CPUs, rounded (a core they keep
    half busy is busy)."""

    def __init__(self, own_cpus: float, node_id: str, every_s: float = CHECK_EVERY_S):
        from ray._private.state import total_resources_per_node  # deferred: ray

        self.own_cpus = own_cpus
        self.node_id = node_id
        self.every_s = every_s
        self.node_cpus = float(total_resources_per_node().get(node_id, {}).get("CPU", 0.0))
        self.usable = len(os.sched_getaffinity(0))
        self.threads = max(1, int(own_cpus))
        self.load = MachineLoad()
        self._checked_at = time.monotonic()  # (the first load reading spans a check)

    def __call__(self) -> int:
        now = time.monotonic()
        if now - self._checked_at < self.every_s:
            return self.threads
        self._checked_at = now
        free, others = self.free_cpus(), self.load.others_busy()
        if free is not None:
            idle = (None if others is None
                    else max(0, self.usable - self.own_cpus - int(others + 0.5)))
            self.threads = min(self.usable,
                               threads_for(self.own_cpus, self.node_cpus, free, idle))
        return self.threads

    def free_cpus(self) -> float | None:
        """The node's CPUs no one holds, per Ray's resource view (None: unknown now)."""
        from ray._private.state import available_resources_per_node  # deferred: ray
        try:
            available = available_resources_per_node()
        except Exception:  # a GCS hiccup must not fail the trial: keep the last answer
            return None
        if self.node_id not in available:
            return None
        return float(available[self.node_id].get("CPU", 0.0))  # (absent when 0)


def thread_share(resources: dict[str, float], node_id: str) -> NodeThreadShare | None:
    """The hook for a trial holding Ray ``resources``; None for a GPU trial (its work is
    on the GPU) and one holding no CPU."""
    if resources.get("GPU", 0) > 0 or resources.get("CPU", 0) <= 0:
        return None
    return NodeThreadShare(float(resources["CPU"]), node_id)
