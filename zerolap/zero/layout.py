"""Where every parameter lives in the flat buffers, which bucket it belongs to, and which part of
each bucket a rank owns. Pure arithmetic, computed once at construction.

Layout (Megatron's distributed-optimizer scheme):

    flat:   | bucket 0                  | bucket 1                  | ...
            | chunk 0 | chunk 1 | ...   | chunk 0 | chunk 1 | ...   |
    params: p_k ... p_j (+ padding)     | p_i ... (+ padding)

* Parameters are placed in the order their gradients are expected to become ready in backward
  (the reverse of registration order), so buckets fill front to back.
* A bucket closes once it holds ``bucket_numel`` elements (a larger parameter gets a bucket of
  its own) and is padded to a multiple of the ranks it is spread over.
* Rank r owns chunk r of every bucket spread over all ranks: a reduce-scatter of a bucket hands
  each rank exactly its chunk, and an all-gather of the bucket rebuilds the parameters from the
  owners' chunks.
* A bucket of expert parameters (``zerolap.moe`` with expert parallelism E) is held alike only by
  every E-th rank (its expert-data-parallel group): it is cut into world_size / E chunks, and
  rank r owns chunk r // E of it (``stride`` E). Its chunk and padding sizes differ from a dense
  bucket's, which is why a shard's size is summed bucket by bucket.

A rank's *shard* is its chunks concatenated in bucket order; ``shard_offset`` maps them there.
"""

from __future__ import annotations

from collections.abc import Hashable, Sequence
from dataclasses import dataclass

__all__ = [
    "BucketLayout",
    "FlatLayout",
    "OwnedRun",
    "ParamSlot",
    "build_layout",
    "coalesce",
    "layout_from_groups",
]


@dataclass(frozen=True)
class ParamSlot:
    """One parameter's place in the flat buffer."""

    index: int  # position in the list given to build_layout
    offset: int
    numel: int
    bucket: int


@dataclass(frozen=True)
class BucketLayout:
    index: int
    start: int  # flat offset of the first element
    end: int  # flat offset one past the padding
    slots: tuple[int, ...]  # indices of its params
    world_size: int  # the ranks its chunks are spread over
    stride: int = 1  # rank r owns chunk r // stride (expert buckets: the expert-parallel size)
    # A reduction bucket made of consecutive buckets (``coalesce``): those, in order, with
    # their own indices (stage 3's units). Its buffer is laid out rank by rank (see
    # ``places``), so that chunk r of the buffer is chunk r of every member: one
    # reduce-scatter hands each rank its chunks of them all.
    members: tuple[BucketLayout, ...] = ()

    @property
    def numel(self) -> int:
        return self.end - self.start

    @property
    def chunk_numel(self) -> int:
        return self.numel // self.world_size

    def chunk(self, rank: int) -> tuple[int, int]:
        """Flat ``(start, end)`` of the chunk owned by data-parallel ``rank`` (of a coalesced
        bucket: ``start`` plus the chunk's place in the bucket's buffer)."""
        start = self.start + rank // self.stride * self.chunk_numel
        return start, start + self.chunk_numel

    def parts(self) -> tuple[BucketLayout, ...]:
        """The buckets whose elements this one holds: its members, or itself."""
        return self.members or (self,)

    def columns(self) -> list[int]:
        """Per part, where its chunk starts within each rank's row of the buffer."""
        starts, column = [], 0
        for part in self.parts():
            starts.append(column)
            column += part.chunk_numel
        return starts

    def places(self, offset: int, numel: int) -> list[tuple[int, int, int]]:
        """Where flat elements ``[offset, offset + numel)`` of one member go in this bucket's
        buffer, as ``(buffer position, position among the elements, count)`` pieces.

        A bucket's own buffer is its flat range. A coalesced one's is rank-major: ranks' rows
        of ``chunk_numel`` elements, each row the member chunks that rank owns, in order; an
        element cut from a member at its chunk boundaries lands piece by piece."""
        at = offset - self.start
        if len(self.members) <= 1 or self.world_size == 1:
            return [(at, 0, numel)]
        if not numel:
            return []
        index = next(i for i, m in enumerate(self.members) if m.start <= offset < m.end)
        member, column = self.members[index], self.columns()[index]
        chunk, row = member.chunk_numel, self.chunk_numel
        pieces, done, i = [], 0, offset - member.start
        while done < numel:
            rank, within = divmod(i, chunk)
            count = min(chunk - within, numel - done)
            pieces.append((rank * row + column + within, done, count))
            done, i = done + count, i + count
        return pieces


@dataclass(frozen=True)
class OwnedRun:
    """Consecutive flat elements ``[start, end)`` of one optimizer group inside one bucket."""

    group: int
    start: int
    end: int
    bucket: int
    counted: bool = True  # whether this rank counts it in the global norm (runtime.norm_share)


@dataclass(frozen=True)
class FlatLayout:
    slots: tuple[ParamSlot, ...]
    buckets: tuple[BucketLayout, ...]
    world_size: int

    @property
    def numel(self) -> int:
        """Flat elements including padding."""
        return self.buckets[-1].end if self.buckets else 0

    @property
    def shard_numel(self) -> int:
        return sum(b.chunk_numel for b in self.buckets)

    def slot_parts(self) -> list[int]:
        """Per slot, its part's position in its bucket's ``parts()``."""
        position = [0] * len(self.slots)
        for bucket in self.buckets:
            for i, part in enumerate(bucket.parts()):
                for slot in part.slots:
                    position[slot] = i
        return position

    def prefix(self, buckets: int) -> FlatLayout:
        """The first ``buckets`` buckets and their parameters: the same flat offsets and shard
        positions, so a component built on the prefix addresses the same memory (stage 3's
        trainable units are the prefix its reducer and optimizer see)."""
        kept = self.buckets[:buckets]
        slots = tuple(s for s in self.slots if s.bucket < buckets)
        return FlatLayout(slots, kept, self.world_size)

    def owned_ranges(self, rank: int) -> list[tuple[int, int]]:
        """Flat ``(start, end)`` of every chunk ``rank`` owns, in bucket order."""
        return [bucket.chunk(rank) for bucket in self.buckets]

    def shard_offset(self, bucket: int) -> int:
        """Where ``bucket``'s chunk starts inside a rank's shard."""
        return sum(b.chunk_numel for b in self.buckets[:bucket])

    def shard_position(self, bucket: int, flat: int) -> int:
        """Where flat offset ``flat`` (inside ``bucket``'s chunk of its owner) sits in the
        owner's shard."""
        chunk_start = self.buckets[bucket].chunk(0)[0]
        chunk_numel = self.buckets[bucket].chunk_numel
        return self.shard_offset(bucket) + (flat - chunk_start) % chunk_numel

    def runs(
        self,
        ranges: list[tuple[int, int]],
        group_of: list[int],
        counted_of: list[bool] | None = None,
    ) -> list[OwnedRun]:
        """Split flat ``ranges`` into maximal runs of parameters of one optimizer group inside
        one bucket, skipping padding. ``group_of[slot]`` is the group of each parameter;
        ``counted_of[slot]`` whether this rank counts it in the global norm (a run holds one
        kind only).
        (A bucket's chunk need not sit next to the previous one's: stage 3 may swap it.)"""
        runs: list[OwnedRun] = []
        for start, end in ranges:
            for slot, lo, hi in self.pieces(start, end):
                group, bucket = group_of[slot], self.slots[slot].bucket
                counted = bool(counted_of[slot]) if counted_of is not None else True
                last = runs[-1] if runs else None
                if last is not None and (last.group, last.bucket, last.end, last.counted) == (
                    group,
                    bucket,
                    lo,
                    counted,
                ):
                    runs[-1] = OwnedRun(group, last.start, hi, last.bucket, counted)
                else:
                    runs.append(OwnedRun(group, lo, hi, bucket, counted))
        return runs

    def pieces(self, start: int, end: int) -> list[tuple[int, int, int]]:
        """``(slot index, start, end)`` for each parameter overlapping flat ``[start, end)``,
        clipped to it; padding is skipped."""
        out = []
        for slot in self.slots:
            lo, hi = max(start, slot.offset), min(end, slot.offset + slot.numel)
            if lo < hi:
                out.append((slot.index, lo, hi))
        return out


def build_layout(
    numels: list[int],
    *,
    bucket_numel: int,
    world_size: int,
    kinds: Sequence[Hashable] | None = None,
    strides: Sequence[int] | None = None,
) -> FlatLayout:
    """Lay out parameters of ``numels`` (already in gradient-ready order) into buckets of about
    ``bucket_numel`` elements, each padded to a multiple of the ranks it is spread over
    (``world_size / strides[i]``; every rank when None). A bucket holds parameters of one kind
    only (``kinds[i]``, all alike if None): a pipeline gives a tied weight a kind of its own
    (its chunks are then the same elements on every stage that holds it, whatever else each
    stage holds) and each virtual stage's parameters theirs (reduced after that chunk's
    backward alone); the engine gives experts spread over ranks a kind of their own, with the
    expert-parallel size as stride."""
    if bucket_numel <= 0:
        raise ValueError(f"reduce_bucket_size must be positive, got {bucket_numel}")
    groups: list[list[int]] = []
    group_strides: list[int] = []
    size = 0
    for index, numel in enumerate(numels):
        new_kind = kinds is not None and index > 0 and kinds[index] != kinds[index - 1]
        if not groups or (groups[-1] and (size + numel > bucket_numel or new_kind)):
            groups.append([])
            group_strides.append(strides[index] if strides is not None else 1)
            size = 0
        groups[-1].append(numel)
        size += numel
    return layout_from_groups(groups, world_size=world_size, strides=group_strides)


def coalesce(layout: FlatLayout, bucket_numel: int) -> FlatLayout:
    """``layout``'s consecutive buckets merged into reduction buckets of at most
    ``bucket_numel`` elements (a larger bucket stays alone): stage 3's units are buckets of
    their own for gathering, but reducing each with a collective of its own costs the host a
    launch and a delivery per unit; merged, one reduce-scatter takes ``reduce_bucket_size``
    worth of them (DeepSpeed's gradient bucket at stage 3). Flat offsets and shard positions
    are the same as ``layout``'s (a rank's chunks of the members are consecutive in its
    shard), but a merged bucket's ``chunk`` is a place in its buffer, not a flat range: what
    addresses parameters (the optimizer, the parameter store) keeps ``layout``. Only buckets
    spread over every rank (stride 1) merge; a size below every bucket (0) merges none."""
    runs: list[list[BucketLayout]] = []
    for bucket in layout.buckets:
        run = runs[-1] if runs else None
        if (
            run is not None
            and bucket.stride == 1
            and run[-1].stride == 1
            and bucket.world_size == run[-1].world_size
            and bucket.end - run[0].start <= bucket_numel
        ):
            run.append(bucket)
        else:
            runs.append([bucket])
    merged, index_of = [], {}
    for index, run in enumerate(runs):
        first = run[0]
        slots = tuple(slot for member in run for slot in member.slots)
        merged.append(
            BucketLayout(
                index, first.start, run[-1].end, slots, first.world_size, first.stride, tuple(run)
            )
        )
        index_of.update((member.index, index) for member in run)
    slots = tuple(ParamSlot(s.index, s.offset, s.numel, index_of[s.bucket]) for s in layout.slots)
    return FlatLayout(slots, tuple(merged), layout.world_size)


def layout_from_groups(
    groups: list[list[int]], *, world_size: int, strides: Sequence[int] | None = None
) -> FlatLayout:
    """One bucket per group of parameter sizes (stage 3: one per module), each padded to a
    multiple of the ranks it is spread over (``world_size`` / ``strides[g]``, all of them if
    None); parameters are numbered in order across groups."""
    if world_size <= 0:
        raise ValueError(f"world_size must be positive, got {world_size}")
    slots: list[ParamSlot] = []
    buckets: list[BucketLayout] = []
    start = 0
    for g, group in enumerate(groups):
        stride = strides[g] if strides is not None else 1
        if world_size % stride:
            raise ValueError(f"bucket {g}: stride {stride} does not divide {world_size} ranks")
        spread = world_size // stride
        offset, members = start, []
        for numel in group:
            slots.append(ParamSlot(len(slots), offset, numel, len(buckets)))
            members.append(len(slots) - 1)
            offset += numel
        end = start + -(-(offset - start) // spread) * spread
        buckets.append(BucketLayout(len(buckets), start, end, tuple(members), spread, stride))
        start = end
    return FlatLayout(tuple(slots), tuple(buckets), world_size)
