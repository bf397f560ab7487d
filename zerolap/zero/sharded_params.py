"""Stage 3's parameter store: this rank's shard, and each unit's full buffer while gathered.

Layout as in stages 0-2 (``zero.layout``), one bucket per fetch unit (``zero.units``): rank r
keeps chunk r of every bucket in ``shard``, the only parameter memory it holds for sure. A unit
is gathered into its own full buffer and its parameters' ``.data`` become views of it; released,
``.data`` is an empty tensor and the buffer's storage shrinks to zero bytes.

The storage object stays and only its memory comes and goes, so that tensors autograd saved in
forward (views such as ``weight.t()``) read the values gathered again for backward instead of
keeping the old buffer alive: between the two passes the unit costs no memory. Persistent units
stay gathered for good and are all-gathered again after each optimizer step (``publish``), in
one collective.

On CPU that memory comes from a pool of released buffers (``_BufferPool``), moved in and out
of the unit's storage by swapping data pointers: a buffer freshly allocated for every gather
would be fresh pages from the kernel, each faulted in and zeroed (with glibc's mmap threshold
low, as the benchmarks set it, ~80k page faults per rank per step on a 42M model, a tenth of the
step). The pool holds at most, per buffer size, as many buffers as were ever gathered at once;
``drop_buffers`` (``engine.empty_partition_cache()``) empties it. On accelerators, whose caching
allocators already reuse memory, and without torch's ``UntypedStorage._swap_data_ptr_``, the
storage is resized to and from zero bytes instead.

With ``offload_param: {device: nvme}`` the chunks of some units live in a swap file instead
(``offload.param_swap``): ``shard`` holds only the chunks kept in memory, and every use of a
swapped chunk (``_chunk_of``, ``shard_slice``) goes through the swap's few buffers.
"""

from __future__ import annotations

import bisect
from collections.abc import Callable

import torch

import zerolap.comm as dist
from zerolap.offload.swap_file import SwapError, set_up_on_every_rank
from zerolap.zero.gather import all_gather_bucket
from zerolap.zero.layout import FlatLayout, OwnedRun
from zerolap.zero.status import ParamStatus, mark, unmark

__all__ = ["ActiveModules", "ShardedParams"]

_CAN_SWAP = hasattr(torch.UntypedStorage, "_swap_data_ptr_")


class _BufferPool:
    """Memory of released units, by size in bytes, given to the next unit of that size."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.pooled = _CAN_SWAP and torch.device(device).type == "cpu"
        self.free: dict[int, list[torch.UntypedStorage]] = {}

    def fill(self, storage: torch.UntypedStorage, nbytes: int) -> None:
        """Give ``storage`` (empty) ``nbytes`` of memory: a pooled buffer when one is free."""
        if not self.pooled:
            storage.resize_(nbytes)
            return
        free = self.free.get(nbytes)
        buffer = free.pop() if free else torch.UntypedStorage(nbytes, device=self.device)
        storage._swap_data_ptr_(buffer)  # buffer is left empty

    def drain(self, storage: torch.UntypedStorage) -> None:
        """Take ``storage``'s memory into the pool, leaving it empty."""
        if not self.pooled:
            storage.resize_(0)
            return
        nbytes = storage.nbytes()
        if nbytes:
            spare = torch.UntypedStorage(0, device=self.device)
            spare._swap_data_ptr_(storage)
            self.free.setdefault(nbytes, []).append(spare)

    def clear(self) -> None:
        self.free.clear()

    def nbytes(self) -> int:
        return sum(size * len(free) for size, free in self.free.items())


class ActiveModules:
    """``param.ds_active_sub_modules`` (DeepSpeed's name): how many running modules hold the
    parameter's unit gathered right now. ``clear()`` drops those holds, as clients do before
    taking the fetch hooks off (TRL's generation); open ``GatheredParameters`` are not
    affected."""

    def __init__(self, store: ShardedParams, unit: int) -> None:
        self.store, self.unit = store, unit

    def __len__(self) -> int:
        return self.store.holds[self.unit]

    def clear(self) -> None:
        self.store.holds[self.unit] = 0


class ShardedParams:
    def __init__(
        self,
        params: list[torch.nn.Parameter],
        layout: FlatLayout,
        persistent: list[bool],
        *,
        trainable_buckets: int,
        dtype: torch.dtype,
        device: torch.device,
        group,
        rank: int,
        src_rank: int,
        native: bool,
        swap=None,
        host=None,
        unit_names: list[str] | None = None,
    ) -> None:
        self.params = params  # in layout slot order
        self.layout = layout
        self.persistent = persistent
        self.trainable_buckets = trainable_buckets
        self.group, self.rank, self.native = group, rank, native
        self.dtype, self.device = dtype, device
        self.itemsize = torch.empty((), dtype=dtype).element_size()
        self._shard_offsets = [layout.shard_offset(b.index) for b in layout.buckets]
        self.swap = self._build_swap(swap, unit_names)  # offload_param nvme: SwappedChunks
        # ``shard`` holds the chunks kept in memory, back to back: where each unit's starts.
        self._resident_at, numel = {}, 0
        for bucket in layout.buckets:
            if self.swap is None or bucket.index not in self.swap:
                self._resident_at[bucket.index] = numel
                numel += bucket.chunk_numel
        # offload_param cpu from an accelerator: the shard lives in (pinned) host memory and
        # each gather copies this rank's chunk up first.
        self.host = host
        if host is not None:
            self.shard = host.empty(numel, dtype)
        else:
            self.shard = torch.zeros(numel, dtype=dtype, device=device)
        self.numel = [b.numel for b in layout.buckets]  # elements of each unit, padding included
        self._pool = _BufferPool(device)
        self.full = [self._unallocated(b.numel) for b in layout.buckets]
        # Each unit's parameters as views of its full buffer, made once per buffer (a buffer
        # keeps its storage object when its memory is drained and filled again), and the one
        # empty tensor every released parameter shows (its storage shared: a resize_ of one
        # released parameter's storage would give them all that memory; nothing here does
        # one): a unit's host work per use is then one assignment per parameter.
        self._views: list[list[torch.Tensor] | None] = [None] * len(layout.buckets)
        self._empty = torch.empty(0, dtype=dtype, device=device)
        self.status = [ParamStatus.SHARDED] * len(layout.buckets)
        self._live_numel = 0  # elements of sharded units not SHARDED (see live_numel)
        self.handles: list = [None] * len(layout.buckets)
        # Who needs a unit whole right now: modules running (the fetcher's hooks) and open
        # GatheredParameters contexts, counted apart so that clearing the one (a client taking
        # the hooks off) cannot undo the other.
        self.holds = [0] * len(layout.buckets)
        self.pins = [0] * len(layout.buckets)
        self.unit_of = {id(p): layout.slots[i].bucket for i, p in enumerate(params)}
        self.after_write_back: list[Callable[[], None]] = []  # e.g. reload the fp32 master
        self._standing: set[int] = set()  # slots showing their full shape (``stand_in``)
        self.fetcher = None  # the ParamFetcher that gathers these units, once one is built
        # Called before GatheredParameters gathers: set while offload_states() has parked the
        # shard (``offload.states.ParkedGuard``), to refuse by name.
        self.refusal = None
        for bucket in layout.buckets:
            self._adopt(bucket.index, src_rank)

    # -- construction -------------------------------------------------------------------------

    def _build_swap(self, plan, unit_names: list[str] | None):
        """``offload_param`` nvme: the swapped chunks, or None when every chunk stays."""
        if plan is None:
            return None
        chunks = [b.chunk_numel for b in self.layout.buckets]
        units = plan.choose(chunks, self.persistent)
        names = {u: unit_names[u] if unit_names else f"unit {u}" for u in units}

        def build():
            return plan.build({u: chunks[u] for u in units}, self.dtype, names) if units else None

        def agree(failed: float) -> float:
            flag = torch.tensor([failed], device=dist.buffer_device(self.group))
            if dist.get_world_size(self.group) > 1:
                dist.all_reduce(flag, op="max", group=self.group)
            return flag.item()

        return set_up_on_every_rank(build, agree, dist.get_rank())

    def _unallocated(self, numel: int) -> torch.Tensor:
        full = torch.empty(numel, dtype=self.dtype, device=self.device)
        full.untyped_storage().resize_(0)
        return full

    def _allocate(self, unit: int) -> torch.Tensor:
        full = self.full[unit]
        self._pool.fill(full.untyped_storage(), full.numel() * self.itemsize)
        return full

    def _adopt(self, unit: int, src_rank: int) -> None:
        """Take the unit's values from its parameters (whole, or sharded by ``zero.Init``),
        keep this rank's chunk, and release the rest: one unit's full size at a time."""
        bucket = self.layout.buckets[unit]
        full = self._allocate(unit)
        full.zero_()
        from_init = True
        for slot in bucket.slots:
            param, place = self.params[slot], self.layout.slots[slot]
            target = full[place.offset - bucket.start : place.offset - bucket.start + place.numel]
            owner = getattr(param, "ds_owner", None)
            if owner is not None:  # zero.Init: ranks agree already
                target.copy_(owner.full_value(param).reshape(-1))
                owner.forget(param)
            else:
                from_init = False
                target.copy_(param.detach().reshape(-1))
            mark(param, ParamStatus.SHARDED, owner=self)
        if not from_init and dist.get_world_size(self.group) > 1:
            dist.broadcast(full, src=src_rank, group=self.group)  # rank 0's initial weights
        self._chunk_of(unit, write=True).copy_(self._own_part(unit, full))
        for slot in bucket.slots:
            self.params[slot].ds_tensor = self._own_elements(slot)
            self.params[slot].ds_active_sub_modules = ActiveModules(self, unit)
        self._attach(unit)
        if not self.persistent[unit]:
            self.release(unit)

    def _own_elements(self, slot: int) -> torch.Tensor:
        """The elements of parameter ``slot`` that this rank's shard holds (a view)."""
        place = self.layout.slots[slot]
        start, end = self.layout.buckets[place.bucket].chunk(self.rank)
        lo, hi = max(start, place.offset), min(end, place.offset + place.numel)
        if lo >= hi or (self.swap is not None and place.bucket in self.swap):
            return self.shard[:0]  # nothing, or only on disk
        at = self.layout.shard_position(place.bucket, lo)
        return self.shard_slice(at, hi - lo)

    # -- gather / release ---------------------------------------------------------------------

    def _chunk_of(self, unit: int, *, write: bool = False) -> torch.Tensor:
        """This rank's chunk of ``unit``: in ``shard``, or read into a swap buffer (valid until
        the next swapped chunk is asked for; ``write``: the caller changes it)."""
        if self.swap is not None and unit in self.swap:
            return self.swap.get(unit, write=write)
        offset = self._resident_at[unit]
        return self.shard[offset : offset + self.layout.buckets[unit].chunk_numel]

    def shard_slice(self, position: int, numel: int, *, write: bool = False) -> torch.Tensor:
        """Elements ``[position, position + numel)`` of this rank's shard, in layout shard
        positions (one unit's chunk; ``_chunk_of`` says how long a swapped one stays valid)."""
        # The last unit starting at or before ``position``: empty chunks share their
        # successor's offset and come before it.
        unit = bisect.bisect_right(self._shard_offsets, position) - 1
        at = position - self._shard_offsets[unit]
        return self._chunk_of(unit, write=write)[at : at + numel]

    def _own_part(self, unit: int, full: torch.Tensor) -> torch.Tensor:
        bucket = self.layout.buckets[unit]
        start, end = bucket.chunk(self.rank)
        return full[start - bucket.start : end - bucket.start]

    def _launch_gather(self, unit: int):
        full = self.full[unit]
        own = self._own_part(unit, full)
        bucket = self.layout.buckets[unit]
        swap = self.swap
        if swap is not None and unit in swap:
            # A swapped chunk is read on the swap's I/O thread and copied in by the gather
            # itself when its turn comes: the caller (a prefetch) does not wait for the read.
            take = swap.stage(unit)
            pinned = [True]  # unpinned once, by the gather or here if it never runs

            def unpin() -> None:
                try:
                    pinned.pop()  # atomic: of two callers, one gets it
                except IndexError:
                    return
                swap.unpin(unit)

            def copy_in() -> None:
                try:
                    own.copy_(take())
                finally:
                    unpin()

            try:
                return all_gather_bucket(
                    full, bucket, rank=self.rank, group=self.group, native=self.native,
                    prepare=copy_in,
                )  # fmt: skip
            except BaseException:
                unpin()  # refused before it was queued: copy_in will never run
                raise
        own.copy_(self._chunk_of(unit), non_blocking=True)  # ordered before the collective
        return all_gather_bucket(full, bucket, rank=self.rank, group=self.group, native=self.native)

    def launch(self, unit: int) -> None:
        """Start gathering ``unit`` (no-op unless it is sharded)."""
        if self.status[unit] != ParamStatus.SHARDED:
            return
        self._allocate(unit)
        self.handles[unit] = self._launch_gather(unit)
        self._set_status(unit, ParamStatus.GATHERING)

    def wait(self, unit: int) -> bool:
        """Make ``unit`` available; True when this had to block on (or start) a gather."""
        if self.status[unit] == ParamStatus.AVAILABLE:
            return False
        self.launch(unit)
        try:
            self.handles[unit].wait()
        except dist.CommError as err:  # a swapped chunk that could not be read: the disk's error
            if isinstance(err.__cause__, SwapError):
                raise err.__cause__ from None
            raise
        self.handles[unit] = None
        self._attach(unit)
        return True

    def _attach(self, unit: int) -> None:
        bucket = self.layout.buckets[unit]
        for slot, view in zip(bucket.slots, self._views_of(unit), strict=True):
            self.params[slot].data = view
        self._set_status(unit, ParamStatus.AVAILABLE)

    def _views_of(self, unit: int) -> list[torch.Tensor]:
        views = self._views[unit]
        if views is None:
            bucket, full = self.layout.buckets[unit], self.full[unit]
            views = []
            for slot in bucket.slots:
                place = self.layout.slots[slot]
                start = place.offset - bucket.start
                views.append(full[start : start + place.numel].view(self.params[slot].ds_shape))
            self._views[unit] = views
        return views

    def release(self, unit: int) -> None:
        """Free ``unit``'s full buffer unless it is persistent or held."""
        if self.persistent[unit] or self.in_use(unit) or self.status[unit] == ParamStatus.SHARDED:
            return
        if self.status[unit] == ParamStatus.GATHERING:
            self.wait(unit)  # the collective must complete on every rank
        for slot in self.layout.buckets[unit].slots:
            self.params[slot].data = self._empty
        self._pool.drain(self.full[unit].untyped_storage())
        self._set_status(unit, ParamStatus.SHARDED)

    def stand_in(self, slot: int) -> bool:
        """Autograd is about to accumulate a gradient into parameter ``slot`` while its unit
        is released: a gradient computed while the parameter was gathered by its user, as a
        custom autograd Function does that gathers the weight it reads itself, in forward and
        again in backward, with ``GatheredParameters`` (TRL's fused LM head). torch shapes the
        gradient it keeps after the parameter, so the parameter shows its full shape for the
        while, over one element of memory; ``drop_stand_in`` ends it once the gradient has
        been taken. Whether it stands in now."""
        if self.status[self.layout.slots[slot].bucket] != ParamStatus.SHARDED:
            return False
        param = self.params[slot]
        one = torch.empty((), dtype=self.dtype, device=self.device)
        param.data = one.expand(param.ds_shape)
        self._standing.add(slot)
        return True

    def drop_stand_in(self, slot: int) -> None:
        if slot in self._standing:
            self._standing.discard(slot)
            if self.status[self.layout.slots[slot].bucket] == ParamStatus.SHARDED:
                self.params[slot].data = self._empty

    def drop_stand_ins(self) -> None:
        """Every stand-in still up: a gradient that never reached its accumulation (an
        ``autograd.grad`` of the weight, a hook that raised) leaves one."""
        for slot in list(self._standing):
            self.drop_stand_in(slot)

    def in_use(self, unit: int) -> bool:
        return bool(self.holds[unit] or self.pins[unit])

    def release_all(self, keep=()) -> None:
        """Release every unit but those in ``keep``."""
        for unit in range(len(self.full)):
            if unit not in keep:
                self.release(unit)
        self.drop_stand_ins()

    def release_orphaned(self) -> None:
        """The engine was dropped without ``destroy()`` (``runtime.release``): no module's
        hook will drop its holds, so every unit not pinned by an open ``GatheredParameters``
        goes back to its shard, and the pooled buffers are freed. Nothing is communicated."""
        self.holds = [0] * len(self.holds)
        self.release_all()
        self.drop_buffers()

    def pinned(self) -> bool:
        """Whether a ``GatheredParameters`` holds some unit gathered."""
        return any(self.pins)

    def device_tensors(self) -> list[torch.Tensor]:
        """The memory the parameters live in (``offload_states``' lp_params): the shard and
        every unit gathered (the persistent ones, and any a ``GatheredParameters`` holds)."""
        gathered = [full for full in self.full if full.untyped_storage().nbytes()]
        return [self.shard, *gathered]

    def drop_buffers(self) -> None:
        """Free the pooled memory of released units (the next gathers allocate afresh)."""
        self._pool.clear()

    def _set_status(self, unit: int, status: ParamStatus) -> None:
        was_sharded = self.status[unit] == ParamStatus.SHARDED
        if not self.persistent[unit] and was_sharded != (status == ParamStatus.SHARDED):
            self._live_numel += self.numel[unit] if was_sharded else -self.numel[unit]
        self.status[unit] = status
        for slot in self.layout.buckets[unit].slots:
            self.params[slot].ds_status = status

    # -- GatheredParameters ---------------------------------------------------------------------

    def hold(self, params: list[torch.nn.Parameter]) -> list[int]:
        """Gather the units of ``params`` and keep them until ``unhold``."""
        if self.refusal is not None:
            self.refusal()
        units = sorted({self.unit_of[id(p)] for p in params})
        for unit in units:
            self.launch(unit)
        for unit in units:
            self.wait(unit)
            self.pins[unit] += 1
        return units

    def unhold(self, units: list[int], modifier_rank: int | None) -> None:
        if modifier_rank is not None:
            self.write_back(units, modifier_rank)
        for unit in units:
            self.pins[unit] -= 1
            self.release(unit)

    # -- the optimizer's side -----------------------------------------------------------------

    def owned_view(self, run: OwnedRun, shard_pos: int) -> torch.Tensor:
        """The shard elements of ``run``, which starts at ``shard_pos`` of this rank's shard
        (a swapped chunk is marked changed: the optimizer writes what it asks for)."""
        return self.shard_slice(shard_pos, run.end - run.start, write=True)

    def settle(self) -> None:
        """Wait for every gather in flight (what a prefetch started; ``publish`` leaves none):
        before the optimizer changes shards they may still be sending. The units stay
        gathered for the use they were started for."""
        for unit, status in enumerate(self.status):
            if status == ParamStatus.GATHERING:
                self.wait(unit)
        if self.host is not None and self.device.type == "cuda":
            # The host writes its shard next (a step in place, a checkpoint's values); a copy
            # up from it may still be running (the wait above orders only the stream).
            torch.cuda.current_stream(self.device).synchronize()

    def publish(self, *, frozen_too: bool = False) -> None:
        """After a step: gathered copies are stale. Sharded units are released (the next use
        gathers the new values); persistent trainable ones are all-gathered again, all in
        flight (frozen ones did not change, unless a checkpoint was loaded: ``frozen_too``)."""
        self.release_all()
        last = len(self.persistent) if frozen_too else self.trainable_buckets
        units = [unit for unit, keep in enumerate(self.persistent[:last]) if keep]
        if self.host is None and len(units) > 1:
            # One collective for them all: a model's persistent units (its LayerNorms, between
            # the sharded layers, each a bucket) are many and small, where a collective's
            # launch costs more than its bytes (host time a GPU waits for). They are never
            # swapped to disk (``offload.param_swap``): their chunks are in ``shard``.
            dist.all_gather_coalesced(
                [self.full[unit] for unit in units],
                [self._chunk_of(unit) for unit in units],
                group=self.group,
            )
            return
        # A shard in host memory (offload_param cpu on an accelerator): each gather copies
        # its chunk up.
        for handle in [self._launch_gather(unit) for unit in units]:
            handle.wait()

    def unshard_all(self) -> None:
        """Every parameter becomes an ordinary whole tensor again (``engine.destroy()``): one
        unit gathered at a time, its parameters given their own copies, the store emptied."""
        for unit, bucket in enumerate(self.layout.buckets):
            self.holds[unit] = self.pins[unit] = 0
            self.wait(unit)
            for slot in bucket.slots:
                param = self.params[slot]
                param.data = param.data.clone()
                unmark(param)
            self.full[unit] = self._unallocated(0)
            self._views[unit] = None
        self._pool.clear()
        self.shard = self.shard[:0]
        if self.swap is not None:
            self.swap.close()
            self.swap = None

    def write_back(self, units: list[int], src_rank: int) -> None:
        """``src_rank`` changed the gathered values of ``units``: every rank takes them and
        keeps its chunk (``GatheredParameters(modifier_rank=...)``)."""
        for unit in units:
            full = self.full[unit]
            if dist.get_world_size(self.group) > 1:
                dist.broadcast(full, src=src_rank, group=self.group)
            self._chunk_of(unit, write=True).copy_(self._own_part(unit, full))
        for callback in self.after_write_back:
            callback()

    # -- accounting ---------------------------------------------------------------------------

    def live_numel(self) -> int:
        """Elements of sharded units currently gathered or in flight."""
        return self._live_numel

    def nbytes(self) -> int:
        """Parameter memory where training runs: the shard (unless it is on the host) and
        every unit's full buffer while it has one."""
        shard = self.shard.numel() * self.itemsize if self.host is None else 0
        return shard + sum(f.untyped_storage().nbytes() for f in self.full)

    def host_bytes(self) -> int:
        """offload_param cpu from an accelerator: the shard, in host memory."""
        return self.shard.numel() * self.itemsize if self.host is not None else 0

    def buffer_bytes(self) -> int:
        """Pooled memory of released units, kept for the next gathers: not model state."""
        return self._pool.nbytes()

    def swap_buffer_bytes(self) -> int:
        """offload_param nvme: the buffers swapped chunks pass through."""
        return self.swap.buffer_bytes() if self.swap is not None else 0

    def swapped_bytes(self) -> int:
        """offload_param nvme: bytes of swap file holding chunks on disk."""
        return self.swap.file_bytes() if self.swap is not None else 0
