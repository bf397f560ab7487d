"""Stage 3's just-in-time parameters: module hooks that gather units before use, prefetch the
ones the recorded order says come next, and release them after.

Per module that needs units (``zero.units``):

* forward pre-hook: fetch its units (wait for them; start them first if nobody prefetched),
  then prefetch ahead along the record, and hold the units while the module runs;
* forward post-hook: drop the hold and release, unless the record says the unit is used again
  within ``stage3_max_reuse_distance`` elements; and, when autograd will run backward through
  the outputs, hook them so that the module's units are fetched again before its backward;
* a unit is released in backward once every one of its parameters' gradients has been
  accumulated (and handed to the reducer); a frozen unit, once the gradients of the module's
  inputs are computed; ``finish_backward`` releases whatever is left.

A parameter read while a module runs without calling its owner, or one a module returns, is
taken over by the innermost hooked module running (``borrow``): fetched with that module's
units from then on. The root runs hooked whatever it owns, to take over what is returned to
it.

The first units of a step are prefetched when the previous step's ``step()`` ends
(``prefetch_next_step``), so that their gathers travel before the forward that needs them
begins; without a step before it, a forward starts its own prefetch.

Prefetch keeps at most ``stage3_prefetch_bucket_size`` elements gathered ahead of use (or one
unit, if that is larger) and never lets more than ``stage3_max_live_parameters`` elements be
gathered at once. Every rank issues the same gathers in the same order because they all see
the same fetches and the same record. The first step, which makes the record, is where ranks
could differ (a module run on some ranks only): there every fetch is first agreed across the
ranks (one small all-gather of the unit's index), so that a difference is named at the fetch
where it happens instead of pairing one rank's gather with another's.
"""

from __future__ import annotations

import math
import time
from dataclasses import asdict, dataclass

import torch
from torch.utils._pytree import tree_leaves

import zerolap.comm as dist
from zerolap.utils.logging import logger
from zerolap.zero.borrowed import owners_of, unwatch, watch
from zerolap.zero.external import register_external_parameter
from zerolap.zero.fetch_trace import FetchTrace
from zerolap.zero.sharded_params import ShardedParams
from zerolap.zero.status import ParamStatus

__all__ = ["FetchStats", "ParamFetcher"]

END_OF_STEP = -1  # what a rank agrees on when its first step has no fetch left


@dataclass
class FetchStats:
    """Counters since the engine was built."""

    fetches: int = 0  # units a module needed
    prefetched: int = 0  # ... that a prefetch had already started or finished
    on_demand: int = 0  # ... whose gather started only when needed
    forward_wait_s: float = 0.0  # time forward blocked on gathers
    backward_wait_s: float = 0.0  # time backward blocked on gathers
    trace_misses: int = 0  # steps whose module order left the record

    def as_dict(self) -> dict:
        return asdict(self)


def _at_first_gradient(tensors: list[torch.Tensor], fn) -> None:
    """Call ``fn()`` once in each backward, when the first of ``tensors``' gradients is
    computed: what ``register_multi_grad_hook(mode="any")`` does, which every hooked module
    pays in every forward, without the lock, dictionary and wrapped function it makes per
    call (README: stage 3's forward on the CPU proxy)."""
    if len(tensors) == 1:  # one gradient per backward: nothing to tell apart

        def hook(grad: torch.Tensor) -> None:
            fn()

    else:
        backwards: set[int] = set()  # the graph tasks it was called in

        def hook(grad: torch.Tensor) -> None:
            task = torch._C._current_graph_task_id()
            if task not in backwards:
                backwards.add(task)
                fn()

    for tensor in tensors:
        tensor.register_hook(hook)


class ParamFetcher:
    def __init__(
        self,
        store: ShardedParams,
        module: torch.nn.Module,
        fetch: dict[torch.nn.Module, list[int]],
        names: list[str],
        *,
        prefetch_numel: int,
        max_live_numel: int,
        max_reuse_distance: int,
        record=None,
    ) -> None:
        self.store = store
        self.record = record  # record(phase, start, end, compute): the engine's phase recorders
        self.names = names
        self.prefetch_numel = prefetch_numel
        self.max_live_numel = max_live_numel
        self.max_reuse_distance = max_reuse_distance
        self.trace = FetchTrace(store.numel)
        self.stats = FetchStats()
        self._prefetched: dict[int, None] = {}  # launched ahead, not yet used (ordered)
        self._carried = False  # whether _prefetched holds step()'s prefetch for the next step
        # Gradients expected per unit in a backward (frozen units expect none).
        self._slots = [
            sum(store.params[slot].requires_grad for slot in b.slots) for b in store.layout.buckets
        ]
        self._due = list(self._slots)  # gradients still to arrive per unit in this backward
        # The first step (from the first engine.forward to its autograd's end) agrees every
        # fetch across the ranks; fetches outside any step (the module called directly) do not.
        self._first, self._agreeing = True, False
        self.module = module  # the root: DeepSpeed's offload object exposes it, TRL reads it
        self._units_of = {m: list(units) for m, units in fetch.items()}  # the lists hooks read
        # The root runs hooked even with no parameter of its own: a parameter handed up
        # (``_hand_up``) above every other hooked module needs a running module to hold it.
        # Hooked for that alone, it borrows nothing that is read (``borrowing``).
        self._bare_root = None if module in self._units_of else module
        self._units_of.setdefault(module, [])
        # Every hook handle, in DeepSpeed's two lists: clients (TRL's generation) remove them
        # and put them back with _register_deepspeed_module, as they do DeepSpeed's.
        self.forward_hooks: list = []  # module pre/post forward hooks
        self.backward_hooks: list = []  # parameter gradient hooks (release after backward)
        self._install_hooks()
        store.fetcher = self  # register_external_parameter finds the fetcher through a param
        # Hooked modules inside their forward, nested, each with the units it holds.
        self.running: list[tuple[torch.nn.Module, list[int]]] = []
        sharded = [
            p for p, keep in zip(store.params, self._persistent_of(), strict=True) if not keep
        ]
        self._watched = owners_of(module, sharded)
        watch(self._watched, self)  # a read of a sharded parameter inside a forward gathers it

    def _persistent_of(self) -> list[bool]:
        """Per parameter of the store, whether its unit stays whole."""
        slots = self.store.layout.slots
        return [self.store.persistent[slots[i].bucket] for i in range(len(self.store.params))]

    def borrowing(self) -> bool:
        """Whether a sharded parameter read now is borrowed: inside a hooked module's forward,
        but not in the root's own code when the root had no unit of its own to gather when
        the engine was built (user code there, a hook reading a released weight, takes nothing
        over, as before the root ran hooked)."""
        return bool(self.running) and self.running[-1][0] is not self._bare_root

    def borrow(self, param: torch.nn.Parameter) -> None:
        """``param`` was read, sharded, or handed up (``_hand_up``) while ``self.running[-1]``
        runs: from now on that module uses it (held until its forward ends, fetched again for
        its backward)."""
        module, held = self.running[-1]
        unit = self.store.unit_of[id(param)]
        register_external_parameter(module, param)  # extends the unit lists its hooks read
        self._fetch([unit], backward=False)
        self.store.holds[unit] += 1  # the module's post-forward hook drops it
        held.append(unit)

    def _install_hooks(self) -> None:
        for module, units in self._units_of.items():
            self._hook_module(module, units)
        for slot, param in enumerate(self.store.params):
            unit = self.store.layout.slots[slot].bucket
            if not self.store.persistent[unit] and param.requires_grad:
                self.backward_hooks += [
                    param.register_hook(self._before_grad(slot)),
                    param.register_post_accumulate_grad_hook(self._on_grad(unit, slot)),
                ]

    def _hook_module(self, module: torch.nn.Module, units: list[int]) -> None:
        self.forward_hooks += [
            module.register_forward_pre_hook(self._pre_forward(units), with_kwargs=True),
            # Also when the forward raises: its units are let go at once.
            module.register_forward_hook(self._post_forward(units), always_call=True),
        ]

    def add_external(self, module: torch.nn.Module, param: torch.nn.Parameter) -> None:
        """``module`` uses ``param`` from now on (``register_external_parameter``)."""
        unit = self.store.unit_of[id(param)]
        if self.store.persistent[unit]:
            return
        units = self._units_of.get(module)
        if units is None:
            self._units_of[module] = [unit]
            self._hook_module(module, self._units_of[module])
        elif unit not in units:
            units.append(unit)
        else:
            return
        self.trace.restart()  # the module fetches one more unit from now on

    # -- step boundaries ----------------------------------------------------------------------

    def begin_step(self) -> None:
        """Called by ``engine.forward``: closes the previous step's record and starts the
        prefetch of this one (beyond what ``prefetch_next_step`` started). The first step's
        fetches are agreed across the ranks."""
        self.end_first_step()  # a first step that ran forward only ends here
        self._agreeing, self._first = self._first, False
        self.trace.begin_step()
        # What a forward-only step left gathered is stale or unused; what the last step()
        # prefetched for the step now beginning is neither (unless released since: a
        # checkpoint loaded), but only this first step after it may keep that.
        if not self._carried:
            self._prefetched.clear()
        self._carried = False
        self._forget_released()
        self._drop_aborted()
        self.store.release_all(keep=self._prefetched)
        self._prefetch()

    def prefetch_next_step(self) -> None:
        """Called when ``step()`` has updated the shards: the first units the next step will
        fetch (per the record) start gathering now, under whatever the program does before its
        next forward. The record itself moves on at that forward, as ever: forwards run in
        between outside the engine (a generation loop) still count as this step's tail."""
        self._forget_released()  # publish() released every unit (unless the step was skipped)
        self._prefetch(self.trace.next_step())
        self._carried = True

    def _forget_released(self) -> None:
        self._prefetched = {
            u: None for u in self._prefetched if self.store.status[u] != ParamStatus.SHARDED
        }

    def end_first_step(self) -> None:
        """The first step's fetches are over (its autograd ended, or the next step began):
        every rank must be at that point too, not fetching one more unit."""
        if self._agreeing:
            self._agreeing = False
            self._agree(END_OF_STEP)

    def _agree(self, unit: int) -> None:
        """In the first step: every rank must be fetching the same unit now."""
        group = self.store.group
        world = dist.get_world_size(group)
        if world == 1:
            return
        mine = torch.tensor([unit], dtype=torch.int64, device=self.store.device)
        units = torch.empty(world, dtype=torch.int64, device=self.store.device)
        dist.all_gather_into_tensor(units, mine, group=group)
        units = units.tolist()
        if len(set(units)) > 1:
            # the same on every rank: each agreed as many fetches before this one
            fetch = self.trace.position + (unit == END_OF_STEP)
            ranks = dist.get_all_ranks_from_group(group)
            needs = ", ".join(
                f"rank {r} {'at the end of its step' if u == END_OF_STEP else repr(self.names[u])}"
                for r, u in zip(ranks, units, strict=True)
            )
            raise RuntimeError(
                f"ZeRO stage 3: the ranks ran different modules in the first step: at its fetch "
                f"#{fetch}, {needs}. Every rank must run the same modules in the "
                "same order (a module used on some ranks only cannot have its parameters "
                "gathered)"
            )

    def _drop_aborted(self) -> None:
        """A forward that raised left its modules inside their forward, holding their units:
        the holds go, or those units would stay gathered, and stale once the step changes
        their shards."""
        for _, held in self.running:
            self._let_go(held)
        self.running.clear()

    def finish_backward(self) -> None:
        """After autograd: release every unit (unused parameters' units included)."""
        self._drop_aborted()
        self.store.release_all()
        self._prefetched.clear()
        self._due = list(self._slots)
        self.trace.end_backward()

    def release_all(self) -> None:
        """``engine.empty_partition_cache()``: the pooled buffers are freed too."""
        self.store.release_all()
        self.store.drop_buffers()
        self._prefetched.clear()

    def remove_hooks(self) -> None:
        """Take every module and parameter hook off the model (``engine.destroy()``)."""
        for handle in self.forward_hooks + self.backward_hooks:
            handle.remove()
        self.forward_hooks, self.backward_hooks = [], []

    def unwatch(self) -> None:
        """Give the modules plain ``_parameters`` back (``engine.destroy()``)."""
        unwatch(self._watched)

    # -- DeepSpeed's offload interface, as TRL's generation drives it -------------------------
    # TRL gathers every parameter, removes the handles in forward_hooks / backward_hooks,
    # generates, then calls _register_deepspeed_module(root) and invalidates the coordinator's
    # trace (DeepSpeed's names). Here the record of the fetch order plays the coordinator.

    @property
    def param_coordinator(self) -> FetchTrace:
        return self.trace

    def _register_deepspeed_module(self, module: torch.nn.Module) -> None:
        """Put every hook back (whatever ``module`` is: DeepSpeed's clients pass the root),
        replacing any still installed so that none runs twice."""
        self.remove_hooks()
        self._install_hooks()

    # -- fetching -----------------------------------------------------------------------------

    def _fetch(self, units: list[int], backward: bool) -> None:
        store = self.store
        for unit in units:
            if not self.trace.observe(unit):
                self._warn_off_trace(unit)
            if self._agreeing:
                self._agree(unit)
            self.stats.fetches += 1
            if unit in self._prefetched:
                self.stats.prefetched += 1
                del self._prefetched[unit]
            elif store.status[unit] == ParamStatus.SHARDED:
                self.stats.on_demand += 1
                self._make_room(store.numel[unit])
                store.launch(unit)
            self._prefetch()
            start = time.perf_counter()
            if store.wait(unit):
                end = time.perf_counter()
                if backward:
                    self.stats.backward_wait_s += end - start
                else:
                    self.stats.forward_wait_s += end - start
                if self.record is not None:
                    self.record("fetch_wait", start, end, False)

    def _prefetch(self, upcoming=None) -> None:
        """Start gathering ``upcoming`` units (default: those the record says come next) within
        the prefetch budget."""
        if self.prefetch_numel <= 0:
            return
        store = self.store
        ahead = sum(store.numel[u] for u in self._prefetched)
        live = store.live_numel()
        for unit in self.trace.upcoming() if upcoming is None else upcoming:
            if store.status[unit] != ParamStatus.SHARDED:
                continue
            numel = store.numel[unit]
            # The next unit is prefetched even when it alone exceeds the budget (as DeepSpeed
            # does): a budget below the largest unit would otherwise never prefetch it.
            over_budget = ahead > 0 and ahead + numel > self.prefetch_numel
            if over_budget or live + numel > self.max_live_numel:
                return
            store.launch(unit)
            self._prefetched[unit] = None
            ahead += numel
            live += numel

    def _make_room(self, numel: int) -> None:
        """Release units kept for reuse (gathered, neither held nor prefetched) until ``numel``
        more elements fit under ``max_live_numel``; those needed last, or never, go first."""
        store = self.store
        if store.live_numel() + numel <= self.max_live_numel:
            return
        kept = [
            u
            for u, status in enumerate(store.status)
            if status == ParamStatus.AVAILABLE
            and not store.persistent[u]
            and not store.in_use(u)
            and u not in self._prefetched
        ]
        distance = self.trace.reuse_distance
        kept.sort(key=lambda u: math.inf if distance(u) is None else distance(u), reverse=True)
        for unit in kept:
            if store.live_numel() + numel <= self.max_live_numel:
                return
            store.release(unit)

    def _warn_off_trace(self, unit: int) -> None:
        self.stats.trace_misses += 1
        if self.stats.trace_misses == 1:
            logger.warning(
                f"ZeRO stage 3: the modules ran in a different order from the recorded step "
                f"(fetch {self.trace.position} was '{self.names[unit]}'); gathering on demand "
                "for the rest of this step and recording the new order. Repeated changes of "
                "order cost the prefetch; stats in engine.fetch_stats()"
            )

    def _keep(self, unit: int) -> bool:
        """Whether the record says ``unit`` is needed again soon enough to stay gathered."""
        distance = self.trace.reuse_distance(unit)
        return (
            distance is not None
            and distance < self.max_reuse_distance
            and self.store.live_numel() <= self.max_live_numel
        )

    # -- hooks --------------------------------------------------------------------------------

    def _pre_forward(self, units: list[int]):
        def hook(module, args, kwargs):
            self._fetch(units, backward=False)
            for unit in units:
                self.store.holds[unit] += 1
            self.running.append((module, list(units)))
            frozen = [u for u in units if u >= self.store.trainable_buckets]
            if frozen and torch.is_grad_enabled():
                self._release_after_backward(frozen, (args, kwargs))

        return hook

    def _release_after_backward(self, frozen: list[int], inputs) -> None:
        """Frozen units get no gradient hook to say that the module's backward is over; the
        gradients of its inputs do: once they are computed, the units gathered again for the
        backward are released."""
        needs_grad = [
            t for t in tree_leaves(inputs) if isinstance(t, torch.Tensor) and t.requires_grad
        ]
        if needs_grad:
            torch.autograd.graph.register_multi_grad_hook(
                needs_grad, lambda grads: self._release(frozen), mode="all"
            )

    def _release(self, units: list[int]) -> None:
        for unit in units:
            self.store.release(unit)

    def _post_forward(self, units: list[int]):
        def hook(module, args, output):
            # A forward run inside a backward is activation checkpointing's recompute: what it
            # saves for the backward now running reads the units' memory, so they stay
            # gathered until their gradients arrive (as units gathered for a backward do).
            recompute = torch.is_grad_enabled() and torch._C._current_graph_task_id() != -1
            held = self._unwind(module, release=not recompute)
            outputs = tree_leaves(output)
            try:
                self._hand_up(outputs)
            finally:  # a gather that failed there (out of memory) must not keep these held
                self._let_go(held, release=not recompute)
            if torch.is_grad_enabled() and units:
                # Not a leaf returned as it is (a parameter handed up, an input passed
                # through): no backward of this module computes its gradient, and a hook on a
                # leaf would stay on it for good.
                needs_grad = [
                    t
                    for t in outputs
                    if isinstance(t, torch.Tensor) and t.requires_grad and t.grad_fn is not None
                ]
                if needs_grad:
                    _at_first_gradient(needs_grad, lambda: self._fetch(units, backward=True))

        return hook

    def _hand_up(self, outputs: list) -> None:
        """A module returned parameters, or views of them (Megatron's layers return their bias
        for the caller to add, ``skip_bias_add``): the hooked module that called it, or the
        nearest one above (the root at least), uses each from now on, as if it had read it
        itself, so that its unit stays gathered while that module runs and is fetched again
        for its backward."""
        if not self.running:
            return  # the module was called outside every hooked forward
        held = self.running[-1][1]
        unit_of = self.store.unit_of  # the store keeps its parameters alive: ids are theirs
        for tensor in outputs:
            if not isinstance(tensor, torch.Tensor):
                continue
            # By id: ``isinstance(x, Parameter)`` runs Parameter's metaclass check, for every
            # output of every module in every forward.
            param, unit = tensor, unit_of.get(id(tensor))
            if unit is None and tensor._base is not None:
                # A view of a parameter reads its unit's memory as the parameter does.
                param = tensor._base
                unit = unit_of.get(id(param))
            if unit is not None and not self.store.persistent[unit] and unit not in held:
                self.borrow(param)

    def _unwind(self, module: torch.nn.Module, *, release: bool = True) -> list[int]:
        """``module``'s forward ended: its entry leaves ``running``, with those above it,
        children whose forward raised and that it caught (a fallback path), whose holds go.
        The units it held; none when it has no entry (a forward that raised around it was
        dropped already)."""
        for k in range(len(self.running) - 1, -1, -1):
            if self.running[k][0] is module:
                for _, held in self.running[k + 1 :]:
                    self._let_go(held, release=release)
                held = self.running[k][1]
                del self.running[k:]
                return held
        return []

    def _let_go(self, units: list[int], *, release: bool = True) -> None:
        """Drop one hold of each of ``units``; a unit no one holds is released (when
        ``release``) unless the record says it is needed again soon."""
        for unit in units:
            self.store.holds[unit] -= 1
            if release and not self.store.holds[unit] and not self._keep(unit):
                self.store.release(unit)

    def _before_grad(self, slot: int):
        def hook(grad: torch.Tensor) -> None:
            if self.store.stand_in(slot):
                # Gone when this backward ends, whatever happened in between (an
                # ``autograd.grad`` takes the gradient without accumulating it).
                engine = torch.autograd.Variable._execution_engine
                engine.queue_callback(lambda: self.store.drop_stand_in(slot))

        return hook

    def _on_grad(self, unit: int, slot: int):
        def hook(param) -> None:
            self._due[unit] -= 1
            if self._due[unit] == 0:  # every gradient of the unit is in the reducer's hands
                self._due[unit] = self._slots[unit]
                self.store.release(unit)
            self.store.drop_stand_in(slot)

        return hook
