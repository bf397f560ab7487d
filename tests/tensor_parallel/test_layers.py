"""Each tensor-parallel layer against the dense layer it was cut from: outputs, input
gradients and weight gradients equal the dense ones (or their slices) to 1e-6 relative in
fp32, with the backward all-reduce overlapped or not (bitwise the same), on 2 and 4 ranks; a
whole GPT likewise with each overlap, the full one running its blocks as two lanes."""

from __future__ import annotations

import math

import pytest
import torch
from torch import nn

import zerolap.comm as dist
from zerolap.tensor_parallel import (
    ColumnParallelLinear,
    RowParallelLinear,
    Split,
    VocabParallelEmbedding,
    parallelize,
    vocab_parallel_cross_entropy,
)
from zerolap.tensor_parallel.layers import block_sizes

RTOL = 1e-6


def relative_error(actual: torch.Tensor, expected: torch.Tensor) -> float:
    scale = expected.abs().max().clamp(min=1e-12)
    return float((actual - expected).abs().max() / scale)


def close(actual: torch.Tensor, expected: torch.Tensor, what: str, rtol: float = RTOL) -> None:
    error = relative_error(actual, expected)
    assert error <= rtol, f"{what}: relative error {error:.3e}"


def _slice(t: torch.Tensor, dim: int, parts: int | tuple[int, ...] = 1) -> torch.Tensor:
    rank, world = dist.get_rank(), dist.get_world_size()
    blocks = t.chunk(parts, dim) if isinstance(parts, int) else t.split(parts, dim)
    return torch.cat([b.chunk(world, dim)[rank] for b in blocks], dim)


def _inputs(*shape, seed=1) -> torch.Tensor:
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed))


def check_column(parts: int | str, overlap: bool, transposed: bool) -> list[torch.Tensor]:
    """``parts``: 1, 3 equal blocks, or ``"gqa"``: blocks of 4, 2 and 2 rows per rank (a QKV
    with half as many key/value heads as query heads)."""
    torch.manual_seed(0)
    world = dist.get_world_size()
    if parts == "gqa":
        parts = (4 * world, 2 * world, 2 * world)
    dense = nn.Linear(12, 3 * 4 * world if parts == 3 else 8 * world)
    if transposed:  # Conv1D's layout: weight (in, out)
        conv = nn.Module()
        conv.weight = nn.Parameter(dense.weight.detach().t().contiguous())
        conv.bias = nn.Parameter(dense.bias.detach().clone())
    layer = ColumnParallelLinear.from_dense(
        conv if transposed else dense,
        group=None,
        parts=parts,
        overlap_backward=overlap,
        transposed=transposed,
    )
    x = _inputs(2, 5, 12).requires_grad_()
    x_dense = x.detach().clone().requires_grad_()
    probe = _inputs(2, 5, dense.out_features, seed=2)
    (dense(x_dense) * probe).sum().backward()
    y = layer(x)
    close(y, _slice(dense(x_dense).detach(), -1, parts), "column output")
    (y * _slice(probe, -1, parts)).sum().backward()
    close(x.grad, x_dense.grad, "column input grad")
    weight_grad = layer.weight.grad.t() if transposed else layer.weight.grad
    close(weight_grad, _slice(dense.weight.grad, 0, parts), "column weight grad")
    close(layer.bias.grad, _slice(dense.bias.grad, 0, parts), "column bias grad")
    gathered = ColumnParallelLinear.from_dense(
        conv if transposed else dense, group=None, parts=parts, gather_output=True,
        transposed=transposed,
    )  # fmt: skip
    close(gathered(x.detach()), dense(x_dense).detach(), "column output gathered whole")
    return [y.detach(), x.grad, layer.weight.grad]


def check_row(transposed: bool) -> None:
    torch.manual_seed(0)
    world = dist.get_world_size()
    dense = nn.Linear(6 * world, 10)
    source = dense
    if transposed:
        source = nn.Module()
        source.weight = nn.Parameter(dense.weight.detach().t().contiguous())
        source.bias = nn.Parameter(dense.bias.detach().clone())
    layer = RowParallelLinear.from_dense(source, group=None, transposed=transposed)
    x = _inputs(3, 6 * world)
    x_dense = x.clone().requires_grad_()
    x_shard = _slice(x, -1).requires_grad_()
    probe = _inputs(3, 10, seed=3)
    (dense(x_dense) * probe).sum().backward()
    y = layer(x_shard)
    close(y, dense(x).detach(), "row output")
    (y * probe).sum().backward()
    close(x_shard.grad, _slice(x_dense.grad, -1), "row input grad")
    weight_grad = layer.weight.grad.t() if transposed else layer.weight.grad
    close(weight_grad, _slice(dense.weight.grad, 1), "row weight grad")
    close(layer.bias.grad, dense.bias.grad, "row bias grad")


def check_row_scatters_whole_input() -> None:
    torch.manual_seed(0)
    dense = nn.Linear(4 * dist.get_world_size(), 5)
    layer = RowParallelLinear.from_dense(dense, group=None, input_is_parallel=False)
    x = _inputs(2, dense.in_features).requires_grad_()
    x_dense = x.detach().clone().requires_grad_()
    dense(x_dense).sum().backward()
    y = layer(x)
    close(y, dense(x_dense).detach(), "row (scattered) output")
    y.sum().backward()
    close(x.grad, x_dense.grad, "row (scattered) input grad")


def check_embedding_and_loss() -> None:
    torch.manual_seed(0)
    world = dist.get_world_size()
    vocab = 10 * world
    embedding = nn.Embedding(vocab, 6, padding_idx=3)
    head = nn.Linear(6, vocab, bias=False)
    head.weight = embedding.weight  # tied
    tokens = torch.randint(vocab, (4, 7), generator=torch.Generator().manual_seed(5))
    targets = torch.randint(vocab, (4 * 7,), generator=torch.Generator().manual_seed(6))
    targets[::5] = -100
    loss = nn.functional.cross_entropy(head(embedding(tokens)).view(-1, vocab), targets)
    loss.backward()

    split = VocabParallelEmbedding.from_dense(embedding, group=None)
    split_head = ColumnParallelLinear.from_dense(head, group=None, weight=split.weight)
    assert split_head.weight is split.weight
    logits = split_head(split(tokens))
    tp_loss = vocab_parallel_cross_entropy(logits.view(-1, vocab // world), targets, None)
    close(tp_loss, loss.detach(), "vocab-parallel loss")
    tp_loss.backward()
    close(split.weight.grad, _slice(embedding.weight.grad, 0), "tied embedding grad")

    # Every token ignored: nan and zero gradients, as torch gives.
    logits = logits.detach().view(-1, vocab // world).requires_grad_()
    ignored = torch.full_like(targets, -100)
    tp_loss = vocab_parallel_cross_entropy(logits, ignored, None)
    assert tp_loss.isnan(), tp_loss
    tp_loss.backward()
    assert torch.equal(logits.grad, torch.zeros_like(logits)), logits.grad


def check_fused_gpt_attention(overlap: str, batch: int, device: str = "cpu") -> list[torch.Tensor]:
    """A whole demo GPT, dense against auto-parallelized, both on ``device``: equal loss and
    gradients; the loss and the parallel model's gradients, on the CPU.

    Equal within RTOL, or within 4x the dense model's own fp32 rounding where that is larger:
    a gradient summed over the batch with cancellation (a bias's) rounds by more than 1e-6 of
    its largest element, in the dense model as in a parallel one that sums the batch's halves
    apart. The rounding is measured against the dense model in float64."""
    import copy

    from zerolap.demo.gpt import GPT, GPTConfig, synthetic_batch

    cfg = GPTConfig(vocab_size=64, seq_len=8, n_layer=2, n_head=4, d_model=16)
    torch.manual_seed(0)
    dense = GPT(cfg).to(device)
    exact = copy.deepcopy(dense).double()
    torch.manual_seed(0)
    model = parallelize(GPT(cfg), None, overlap=overlap).to(device)
    tokens, targets = (t.to(device) for t in synthetic_batch(cfg, batch, seed=4))
    dense(tokens, targets).backward()
    exact(tokens, targets).backward()
    exact_params = dict(exact.named_parameters())
    loss = model(tokens, targets)
    close(loss, dense(tokens, targets).detach(), "GPT loss")
    loss.backward()
    dense_params = dict(dense.named_parameters())
    for name, param in model.named_parameters():
        expected = dense_params[name].grad
        truth = exact_params[name].grad.to(expected.dtype)
        split = getattr(param, "tp_split", None)
        if split is not None:
            expected, truth = split.take(expected), split.take(truth)
        rounding = relative_error(expected, truth)  # of this rank's piece, as compared
        close(param.grad, expected, f"GPT grad {name}", max(RTOL, 4 * rounding))
    return [loss.detach().cpu()] + [p.grad.cpu() for p in model.parameters()]


@pytest.mark.parametrize("world_size", [2, 4])
def test_column_parallel(ranks, world_size):
    for parts in (1, 3, "gqa"):
        for transposed in (False, True):
            on = ranks(world_size).run(check_column, parts, True, transposed)
            off = ranks(world_size).run(check_column, parts, False, transposed)
            for a, b in zip(on, off, strict=True):
                for x, y in zip(a, b, strict=True):
                    assert torch.equal(x, y), "overlap changed a result"


def check_readers_of_one_tensor(overlap: bool) -> list[torch.Tensor]:
    """Three column-parallel layers reading one tensor (Llama's q/k/v) reduce its gradient
    once, and equal the dense layers' gradients: when all outputs make the loss; when one
    takes no part (its siblings' partial gradients are still reduced and added); and in a
    backward after an ``autograd.grad`` of one weight alone, which left a partial input
    gradient behind that must not count again."""
    from zerolap.comm.logger import COMMS_LOGGER
    from zerolap.tensor_parallel.mappings import BACKWARD

    torch.manual_seed(0)
    world = dist.get_world_size()
    denses = [nn.Linear(12, 4 * world) for _ in range(3)]
    layers = [
        ColumnParallelLinear.from_dense(d, group=None, overlap_backward=overlap) for d in denses
    ]
    x = _inputs(5, 12)
    results = []
    # The second time, layer 1's output is not used; the third, a weight's gradient is taken
    # alone first; the fourth, that too, and then a backward reaching x through none of them.
    for used, weight_first in (((0, 1, 2), False), ((0, 2), False), ((0, 1, 2), True), ((), True)):
        want_x, got_x = x.clone().requires_grad_(), x.clone().requires_grad_()
        if used:
            sum(denses[i](want_x * 1.5).square().sum() for i in used).backward()
        else:
            (want_x * 1.5).square().sum().backward()
        h = got_x * 1.5  # an intermediate, as a norm's output is
        outs = [layer(h) for layer in layers]
        if used:
            loss = sum(_gathered(outs[i]).square().sum() for i in used)
        else:  # the weight's gradient from the readers' outputs, then a loss on h alone
            weight_loss = _gathered(outs[0]).square().sum()
            torch.autograd.grad(weight_loss, [layers[0].weight])
            loss = h.square().sum()
        if weight_first and used:
            torch.autograd.grad(loss, [layers[0].weight], retain_graph=True)
        dist.configure(enabled=True, prof_all=True)
        COMMS_LOGGER.reset()
        loss.backward()
        calls = [r.message_bytes for r in COMMS_LOGGER.records if r.op == BACKWARD]
        dist.configure(enabled=False)
        # One all-reduce of the input gradient; none when no reader is on the way.
        assert calls == ([x.numel() * 4] if used else []), calls
        close(got_x.grad, want_x.grad, f"input gradient, outputs {used} used")
        for i in used:
            close(layers[i].weight.grad, _slice(denses[i].weight.grad, 0), f"weight {i}")
        results.append(got_x.grad)
        for module in (*denses, *layers):
            module.zero_grad()
    return results


def _gathered(y: torch.Tensor) -> torch.Tensor:
    from zerolap.tensor_parallel import gather_from_region

    return gather_from_region(y, None)


def test_readers_of_one_tensor_reduce_once(ranks):
    on = ranks(2).run(check_readers_of_one_tensor, True)[0]
    off = ranks(2).run(check_readers_of_one_tensor, False)[0]
    for a, b in zip(on, off, strict=True):
        assert torch.equal(a, b), "overlap changed a result"


@pytest.mark.parametrize("world_size", [2, 4])
def test_row_parallel(ranks, world_size):
    ranks(world_size).run(check_row, False)
    ranks(world_size).run(check_row, True)
    ranks(world_size).run(check_row_scatters_whole_input)


@pytest.mark.parametrize("world_size", [2, 4])
def test_vocab_parallel_embedding_head_and_loss(ranks, world_size):
    ranks(world_size).run(check_embedding_and_loss)


@pytest.mark.parametrize("world_size", [2, 4])
@pytest.mark.parametrize("overlap", ["off", "backward", "full"])
def test_gpt_parallelized_equals_dense(ranks, world_size, overlap):
    """Full overlap splits each block's micro-batch (5: halves of 3 and 2) into two lanes."""
    ranks(world_size).run(check_fused_gpt_attention, overlap, 5)


@pytest.mark.parametrize(
    ("shape", "dim", "blocks"),
    [((24, 5), 0, (8, 8, 8)), ((16, 5), 0, (8, 4, 4)), ((3, 16, 2), 1, (8, 4, 4))],
)
def test_split_pieces_map_onto_the_whole(shape, dim, blocks):
    """Each rank's piece, cut by ``take``, written back by ``put``, and its flat elements as
    ``full_ranges`` says they lie in the whole (what checkpoints store)."""
    full = torch.arange(math.prod(shape)).reshape(shape)
    rebuilt = torch.full_like(full, -1)
    for index in range(4):
        split = Split(shape, dim, blocks, index, 4)
        piece = split.take(full)
        split.put(piece, rebuilt)
        flat = piece.flatten()
        for lo, hi in ((0, flat.numel()), (1, flat.numel() - 2), (3, 7)):
            covered = []
            for start, end, offset in split.full_ranges(lo, hi):
                assert torch.equal(flat[lo + offset : lo + offset + end - start],
                                   full.flatten()[start:end])  # fmt: skip
                covered += range(lo + offset, lo + offset + end - start)
            assert covered == list(range(lo, hi))
    assert torch.equal(rebuilt, full)


def test_block_sizes_are_checked_by_name():
    assert block_sizes(24, 3, 4, "w") == (8, 8, 8)
    assert block_sizes(16, (8, 4, 4), 4, "w") == (8, 4, 4)
    with pytest.raises(ValueError, match=r"w has 16 .* blocks \[8, 4, 2\] add up to 14"):
        block_sizes(16, (8, 4, 2), 2, "w")
    with pytest.raises(ValueError, match=r"not divisible by the tensor-parallel size 4 in blocks"):
        block_sizes(12, (8, 2, 2), 4, "w")
    with pytest.raises(
        ValueError, match=r"not divisible by the tensor-parallel size 2 in 3 blocks"
    ):
        block_sizes(15, 3, 2, "w")
