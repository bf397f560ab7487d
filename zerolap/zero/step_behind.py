"""Stages 1-2 with the optimizer state on disk: the swapped sub-groups step under the next
forward (``offload_optimizer: {device: nvme, defer_step: true}``).

With the state on disk a step is mostly I/O: every swapped sub-group is read, stepped and
written back (``offload.optimizer_swap``). ``buffer_count`` sub-groups are read ahead during the
backward and written behind under the next forward; inside ``step()`` the rest would stream at
the disk's speed with nothing to hide under, because the step cannot start before the global
norm is known. But nothing needs a bucket's updated parameters before the first module that uses
them runs in the next forward, and that is where the bucket's all-gather is waited
(``zero.in_flight``). So ``step()`` steps the resident runs only and returns; each swapped
sub-group steps as part of the all-gather that first needs it, on the ring's thread
(``comm.ring``: a ring op's ``prepare`` runs there just before the op, in the group's one order):

* the buckets are gathered in the order forward needs them (the reverse of bucket order) and the
  swapped sub-groups are laid out in that order too, so the gather of bucket b first steps every
  sub-group, not yet stepped, that holds this rank's runs of b (``Stepping.ready``);
* after the last gather, one more ring op agrees over the ranks whether any rank's step failed.

The forward waits for each bucket where it did before, now for its step as well; any other
reader of the parameters waits for all of them (``FlatParams.settle``); the optimizer's own
readers (the next step, checkpoints, state dicts) and the next backward, which reuses the
gradient buffers the steps read, wait for the agreement (``ZeroOptimizer.finish_step``). A failed
step is raised there, on every rank, where the step inside ``step()`` raises it in ``step()``;
the gathers after a failure still run, so no rank is left waiting in one.

The ring's thread runs the client optimizer while the training thread goes on, perhaps stepping
a learning-rate scheduler. So it calls a *twin* of the optimizer (``twin_of``) that shares its
state but holds its own copy of the param groups' entries, as they were when the step began.
That is sound for optimizers whose ``step()`` never writes their groups' entries (``can_defer``:
torch's and zerolap's own); with any other the whole step stays inside ``step()``. The twin steps
through its class's own ``step``, without torch's step hooks: a hook may read the model, whose
parameters are in flight then, and waiting for them on the ring's thread would wait for itself.
So a step of an optimizer with hooks, or with a ``step`` of its own on the instance, runs inside
``step()`` (``steps_apart``), still followed by the same gathers and the same agreement: which
collectives run never depends on what one rank registered.
"""

from __future__ import annotations

import functools
from collections.abc import Iterator

import torch
import torch.optim.optimizer as torch_optimizer

from zerolap.zero.sub_groups import SubGroup

__all__ = ["Stepping", "can_defer", "steps_apart", "twin_of"]

_OWN_ENTRIES = ("torch.optim.", "zerolap.ops.")  # their step() reads the groups' entries only


def can_defer(optimizer: torch.optim.Optimizer) -> bool:
    """Whether ``optimizer``'s step can run on another thread through a twin: its class is
    torch's or zerolap's own, which never write their param groups' entries."""
    return type(optimizer).__module__.startswith(_OWN_ENTRIES)


def steps_apart(optimizer: torch.optim.Optimizer) -> bool:
    """Whether this step of ``optimizer`` must run inside ``step()``: ``step()`` runs hooks (its
    own, or torch's global ones), or the instance has a ``step`` of its own that the twin would
    skip (a scheduler's call counter aside)."""
    own = optimizer.__dict__.get("step")
    return (own is not None and not hasattr(own, "_wrapped_by_lr_sched")) or bool(
        getattr(optimizer, "_optimizer_step_pre_hooks", None)
        or getattr(optimizer, "_optimizer_step_post_hooks", None)
        or getattr(torch_optimizer, "_global_optimizer_pre_hooks", None)
        or getattr(torch_optimizer, "_global_optimizer_post_hooks", None)
    )


def twin_of(optimizer: torch.optim.Optimizer) -> torch.optim.Optimizer:
    """A second handle on ``optimizer``: the same state (one dict), its own copy of the param
    groups' entries (the ``params`` lists shared)."""
    twin = object.__new__(type(optimizer))
    twin.__dict__.update(optimizer.__dict__)
    # The class's step without torch's hook wrapper: no hook (one registered meanwhile
    # included) runs on the ring's thread. It also replaces a scheduler's call counter, bound to
    # the original; the scheduler's check that the optimizer stepped before it is answered here,
    # as the counter would answer it.
    step = type(optimizer).step
    twin.step = functools.partial(
        step.__wrapped__ if getattr(step, "hooked", False) else step, twin
    )
    if hasattr(optimizer.__dict__.get("step"), "_wrapped_by_lr_sched"):
        optimizer._opt_called = True
    twin.param_groups = [
        {key: value if key == "params" else _copy(value) for key, value in group.items()}
        for group in optimizer.param_groups
    ]
    return twin


def _copy(value):
    return value.clone() if isinstance(value, torch.Tensor) else value


class Stepping:
    """One step's swapped sub-groups, stepped in their order as the gathers needing them are
    prepared. ``steps`` yields each sub-group once it has stepped (None: nothing to step here,
    because this rank swaps nothing or, ``in_step``, stepped them inside ``step()``);
    ``highest[p]`` is the highest bucket holding a run of the ``p``-th. A failure, before
    (``failure``: the step inside ``step()``) or while stepping, stops the stepping and is kept
    for the agreement; the gathers still run."""

    def __init__(
        self,
        steps: Iterator[SubGroup] | None,
        highest: list[int],
        failure: Exception | None,
        *,
        in_step: bool = False,
    ) -> None:
        self._steps = steps
        self._highest = highest if steps is not None else []
        self._next = 0  # position of the next sub-group to step
        self.failure = failure
        self.in_step = in_step

    def ready(self, bucket: int) -> None:
        """Step every sub-group holding a run of ``bucket`` (and those before it in the order);
        runs on the ring's thread, so it raises nothing: a failure is kept."""
        try:
            while (
                self.failure is None
                and self._next < len(self._highest)
                and self._highest[self._next] >= bucket
            ):
                next(self._steps)
                self._next += 1
            if self.failure is None and self._next == len(self._highest) and self._steps:
                for _ in self._steps:  # the pass's end (the heap given back)
                    pass
                self._steps = None
        except Exception as error:
            self.failure = error

    def stop(self) -> None:
        """Step nothing more (the gathers were not all queued: the step is not whole)."""
        self.failure = self.failure or RuntimeError("the parameter gathers were not all started")
