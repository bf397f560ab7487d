"""Stage 3 as DeepSpeed's clients use it: TRL's generation (all parameters gathered, the fetch
hooks taken off and put back through DeepSpeed's offload names), external parameters (a weight
used by a module that does not own it), leaf modules (a block whose children run unevenly),
and the argument shapes ``GatheredParameters`` receives. Training results are checked against
one process."""

from __future__ import annotations

import contextlib
import itertools

import pytest
import torch
import torch.utils.checkpoint

import zerolap
import zerolap.comm as dist
from tests.logs import captured_logs
from zerolap.utils import set_z3_leaf_modules
from zerolap.zero import GatheredParameters, Init, ZeroParamStatus, register_external_parameter

TIMEOUT = 90.0
MICRO = 2


def _config(**zero) -> dict:
    return {
        "train_micro_batch_size_per_gpu": MICRO,
        "gradient_clipping": 0.0,
        "optimizer": {"type": "AdamW", "params": {"lr": 0.05}},
        "zero_optimization": {"stage": 3, "stage3_param_persistence_threshold": 0, **zero},
    }


def _batch(step: int, width: int = 8) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(100 + step)
    return torch.randn(MICRO * 2, width, generator=g), torch.randn(MICRO * 2, 1, generator=g)


def _mine(tensor: torch.Tensor) -> torch.Tensor:
    rank = dist.get_rank()
    return tensor[rank * MICRO : rank * MICRO + MICRO]


def _whole(params) -> list[torch.Tensor]:
    params = list(params)
    with GatheredParameters(params):
        return [p.detach().clone() for p in params]


def _reference(build, steps: int, forward=None) -> list[torch.Tensor]:
    model = build()
    opt = torch.optim.AdamW(model.parameters(), lr=0.05, weight_decay=0.0)  # as ds_config's AdamW
    for param in model.parameters():  # flat buffers give unused parameters zero gradients
        param.grad = torch.zeros_like(param)
    for step in range(steps):
        x, y = _batch(step)
        opt.zero_grad(set_to_none=False)
        out = model(x) if forward is None else forward(model, x, step)
        torch.nn.functional.mse_loss(out, y).backward()
        opt.step()
    return [p.detach().clone() for p in model.parameters()]


def _diff(a, b) -> float:
    return max((x - y).abs().max().item() for x, y in zip(a, b, strict=True))


# -- TRL's generation ----------------------------------------------------------------------------


def mlp() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(
        torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Linear(16, 16), torch.nn.Linear(16, 1)
    )


def _train_step(engine, step: int) -> None:
    x, y = _batch(step)
    engine.backward(torch.nn.functional.mse_loss(engine(_mine(x)), _mine(y)))
    engine.step()


def check_generation_interface() -> dict:
    model = mlp()
    engine, *_ = zerolap.initialize(model=model, config=_config())
    _train_step(engine, 0)
    offload = engine.optimizer.parameter_offload  # what TRL reaches for
    hooks = (len(offload.forward_hooks), len(offload.backward_hooks))
    # TRL's unwrap_model_for_generation, step by step.
    with GatheredParameters(engine.parameters()):
        for _, param in itertools.chain(
            offload.module.named_parameters(recurse=True), offload.module.ds_external_parameters()
        ):
            param.ds_active_sub_modules.clear()
        for handle in offload.forward_hooks + offload.backward_hooks:
            handle.remove()
        offload.forward_hooks, offload.backward_hooks = [], []
        available = all(p.ds_status == ZeroParamStatus.AVAILABLE for p in model.parameters())
        with torch.no_grad():
            generated = model(torch.ones(3, 8))  # the bare module, no hooks
        if not offload.param_coordinator.is_invalid_trace():
            offload.param_coordinator._invalidate_trace()
        offload._register_deepspeed_module(offload.module)
    restored = (len(offload.forward_hooks), len(offload.backward_hooks))
    released = all(p.ds_status == ZeroParamStatus.NOT_AVAILABLE for p in model.parameters())
    for step in (1, 2):
        _train_step(engine, step)
    return {
        "hooks": (hooks, restored),
        "available": available,
        "released": released,
        "generated": generated.shape,
        "params": _whole(model.parameters()),
    }


def test_trls_generation_takes_the_hooks_off_and_puts_them_back(ranks):
    reference = _reference(mlp, 3)
    for result in ranks(2).run(check_generation_interface, timeout=TIMEOUT):
        before, after = result["hooks"]
        assert before == after and before[0] > 0 and before[1] > 0
        assert result["available"] and result["released"]
        assert result["generated"] == (3, 1)
        assert _diff(result["params"], reference) < 1e-5


# -- external parameters --------------------------------------------------------------------------


class Borrower(torch.nn.Module):
    """Uses the owner's weight without calling the owner."""

    def __init__(self, owner: torch.nn.Linear) -> None:
        super().__init__()
        self.owner = [owner]  # not a child: the weight is only borrowed
        self.scale = torch.nn.Parameter(torch.ones(8))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return (x * self.scale) @ self.owner[0].weight.t()


class Borrowing(torch.nn.Module):
    def __init__(self, register: bool) -> None:
        super().__init__()
        self.owner = torch.nn.Linear(8, 8)
        self.borrower = Borrower(self.owner)
        self.head = torch.nn.Linear(8, 1)
        if register:
            register_external_parameter(self.borrower, self.owner.weight)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(torch.tanh(self.borrower(x)))


def borrowing(register: bool = False) -> Borrowing:
    torch.manual_seed(0)
    return Borrowing(register)


def check_external_parameters(when: str) -> dict:
    if when == "in __init__, under zero.Init":
        with Init(config_dict_or_path=_config()):
            torch.manual_seed(0)
            model = Borrowing(register=True)
    else:
        model = borrowing()
    engine, *_ = zerolap.initialize(model=model, config=_config())
    if when == "after initialize":
        register_external_parameter(model.borrower, model.owner.weight)
    for step in range(3):
        _train_step(engine, step)
    pairs = list(model.borrower.ds_external_parameters())
    return {
        "params": _whole(model.parameters()),
        "pairs": [p is model.owner.weight for _, p in pairs],
    }


@pytest.mark.parametrize("when", ["in __init__, under zero.Init", "after initialize"])
def test_an_external_parameter_is_gathered_for_the_module_that_uses_it(ranks, when):
    reference = _reference(borrowing, 3)
    for result in ranks(2).run(check_external_parameters, when, timeout=TIMEOUT):
        assert _diff(result["params"], reference) < 1e-5
        assert result["pairs"] == [True]


def check_unregistered_borrowing() -> dict:
    model = borrowing()
    engine, *_ = zerolap.initialize(model=model, config=_config())
    for step in range(3):
        _train_step(engine, step)
    pairs = list(model.borrower.ds_external_parameters())
    return {
        "params": _whole(model.parameters()),
        "pairs": [p is model.owner.weight for _, p in pairs],
    }


def test_an_unregistered_borrow_is_noticed_and_registered(ranks):
    # Without register_external_parameter the read of the owner's weight inside the borrower's
    # forward finds it sharded: it is gathered there and registered, as DeepSpeed does.
    reference = _reference(borrowing, 3)
    for result in ranks(2).run(check_unregistered_borrowing, timeout=TIMEOUT):
        assert _diff(result["params"], reference) < 1e-5
        assert result["pairs"] == [True]


# -- leaf modules ---------------------------------------------------------------------------------


class Experts(torch.nn.Module):
    """Routes the whole batch to one expert, chosen by its data: ranks pick different ones."""

    def __init__(self) -> None:
        super().__init__()
        self.experts = torch.nn.ModuleList(torch.nn.Linear(8, 8) for _ in range(3))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.experts[int(x.abs().sum() * 10) % 3](x)


class Routed(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.moe = Experts()
        self.head = torch.nn.Linear(8, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(torch.tanh(self.moe(x)))


def routed() -> Routed:
    torch.manual_seed(0)
    return Routed()


def check_leaf_module() -> dict:
    model = routed()
    set_z3_leaf_modules(model, [Experts])
    engine, *_ = zerolap.initialize(model=model, config=_config())
    chosen = []
    for step in range(3):
        x, _ = _batch(step)
        chosen.append(int(_mine(x).abs().sum() * 10) % 3)
        _train_step(engine, step)
    return {
        "params": _whole(model.parameters()),
        "chosen": chosen,
        "units": engine.units.names,
        "leaf_param": all(p.ds_z3_leaf_module is model.moe for p in model.moe.parameters()),
    }


def reference_routed(steps: int) -> list[torch.Tensor]:
    def forward(model, x, step):  # each rank's half routed by its own data, as the engine does
        halves = [x[r * MICRO : r * MICRO + MICRO] for r in range(2)]
        return torch.cat([model(h) for h in halves])

    return _reference(routed, steps, forward)


def test_a_leaf_module_is_gathered_whole_when_its_children_run_unevenly(ranks):
    reference = reference_routed(3)
    results = ranks(2).run(check_leaf_module, timeout=TIMEOUT)
    assert results[0]["chosen"] != results[1]["chosen"]  # the ranks really diverge
    for result in results:
        assert _diff(result["params"], reference) < 1e-5
        assert result["leaf_param"]
        assert "moe" in result["units"] and not any("experts" in u for u in result["units"])


# -- GatheredParameters' argument shapes ------------------------------------------------------


def check_gathered_shapes() -> dict:
    model = mlp()
    zerolap.initialize(model=model, config=_config())
    first, last = model[0], model[3]
    plain = torch.ones(3)
    with GatheredParameters([first.weight, None, plain, first.weight, last.bias]) as got:
        shapes = [tuple(p.shape) for p in got]
        status = first.weight.ds_status
    with GatheredParameters(p for p in last.parameters()):  # a generator
        generator = [p.numel() for p in last.parameters()]
    with GatheredParameters(first.weight, modifier_rank=0):  # one tensor, written on rank 0
        if dist.get_rank() == 0:
            with torch.no_grad():
                first.weight.fill_(0.25)
    with GatheredParameters([], modifier_rank=0):
        pass
    with GatheredParameters([last.weight], fwd_module=model[2]):
        pass
    return {
        "shapes": shapes,
        "status": status,
        "generator": generator,
        "written": _whole([first.weight])[0].unique().tolist(),
        "after": first.weight.ds_status,
        "registered": [p is last.weight for _, p in model[2].ds_external_parameters()],
    }


def test_gathered_parameters_takes_what_clients_pass(ranks):
    for result in ranks(2).run(check_gathered_shapes, timeout=TIMEOUT):
        assert result["shapes"] == [(16, 8), (3,), (1,)]  # None dropped, duplicates once
        assert result["status"] == ZeroParamStatus.AVAILABLE
        assert result["generator"] == [16, 1]
        assert result["written"] == [0.25]
        assert result["after"] == ZeroParamStatus.NOT_AVAILABLE
        assert result["registered"] == [True]


# -- parameters read without calling their module ----------------------------------------------


class Attention(torch.nn.Module):
    """torch's MultiheadAttention reads out_proj.weight without calling out_proj."""

    def __init__(self) -> None:
        super().__init__()
        # No biases: the key bias has a gradient of exactly 0 in theory and of rounding noise
        # in practice, which Adam turns into steps of any size.
        self.attention = torch.nn.MultiheadAttention(8, 2, batch_first=True, bias=False)
        self.head = torch.nn.Linear(8, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        seq = x.view(x.shape[0], 2, 4).repeat(1, 1, 2)
        out, _ = self.attention(seq, seq, seq, need_weights=False)
        return self.head(out.mean(dim=1))


def attention() -> Attention:
    torch.manual_seed(0)
    return Attention()


def check_borrowed_parameter() -> dict:
    model = attention()
    engine, *_ = zerolap.initialize(model=model, config=_config())
    for step in range(3):
        _train_step(engine, step)
    misses = engine.fetch_stats()["trace_misses"]
    with torch.no_grad():  # the bare module, as a Trainer evaluates during training
        evaluated = model(_batch(9)[0])
    out_proj = model.attention.out_proj.weight
    return {
        "params": _whole(model.parameters()),
        "evaluated": evaluated,
        "registered": [p is out_proj for _, p in model.attention.ds_external_parameters()],
        "released": out_proj.ds_status == ZeroParamStatus.NOT_AVAILABLE,
        "misses": misses,
    }


def test_a_parameter_read_without_calling_its_module_is_gathered(ranks):
    reference = attention()
    expected = _reference(attention, 3)
    with torch.no_grad():
        for param, value in zip(reference.parameters(), expected, strict=True):
            param.copy_(value)
        evaluated = reference(_batch(9)[0])
    for result in ranks(2).run(check_borrowed_parameter, timeout=TIMEOUT):
        assert _diff(result["params"], expected) < 1e-5
        assert (result["evaluated"] - evaluated).abs().max().item() < 1e-5
        assert result["registered"] == [True] and result["released"]
        assert result["misses"] == 0  # the first step recorded the borrow; later ones agree


# -- a parameter a module returns (Megatron's skip_bias_add) ----------------------------------


class ReturnsItsBias(torch.nn.Linear):
    """Megatron's ``skip_bias_add``: the output without the bias, and the bias (or a view of
    it), which the caller adds (fused with what follows)."""

    as_view = False

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        bias = self.bias.view(1, -1) if self.as_view else self.bias
        return torch.nn.functional.linear(x, self.weight), bias


class PassesTheBiasOn(torch.nn.Linear):
    """Hooked for its own weight; returns its child's bias further up."""

    def __init__(self) -> None:
        super().__init__(8, 8)
        self.inner = ReturnsItsBias(8, 8)

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.nn.Parameter]:
        return self.inner(torch.tanh(super().forward(x)))


class BiasUser(torch.nn.Module):
    """No parameter of its own, so no module of its own is hooked around the use: the bias is
    multiplied, so its backward reads the bias's values too."""

    def __init__(self) -> None:
        super().__init__()
        self.first = torch.nn.Linear(8, 8)
        self.block = PassesTheBiasOn()
        self.head = torch.nn.Linear(8, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out, bias = self.block(self.first(x))
        return self.head(torch.tanh(out * bias + bias))


def bias_user(as_view: bool = False) -> BiasUser:
    torch.manual_seed(0)
    model = BiasUser()
    model.block.inner.as_view = as_view
    return model


def check_returned_parameter(as_view: bool) -> dict:
    model = bias_user(as_view)
    engine, *_ = zerolap.initialize(model=model, config=_config(stage3_max_reuse_distance=0))
    fetcher = engine.fetcher
    taking_over = fetcher.borrow

    def out_of_memory(param):
        raise torch.OutOfMemoryError("out of memory, say")

    # The first hand-up fails (its gather, say), and the loop catches the error and goes on.
    fetcher.borrow = out_of_memory
    with pytest.raises(torch.OutOfMemoryError):
        engine(_mine(_batch(0)[0]))
    fetcher.borrow = taking_over
    held_after_error = sum(fetcher.store.holds)
    with captured_logs() as logs:
        for step in range(4):
            _train_step(engine, step)
            if step == 0:  # evaluation through the engine, right after the record restarted
                with torch.no_grad():
                    engine(_mine(_batch(8)[0]))
    misses = engine.fetch_stats()["trace_misses"]
    bias = model.block.inner.bias
    with torch.no_grad():  # the bare module, as a Trainer evaluates during training
        evaluated = model(_batch(9)[0])
    return {
        "params": _whole(model.parameters()),
        "evaluated": evaluated,
        "registered": [p is bias for _, p in model.ds_external_parameters()],
        "released": bias.ds_status == ZeroParamStatus.NOT_AVAILABLE,
        "misses": misses,
        "warnings": [line for line in logs if line.startswith("WARNING")],
        "hooks": len(bias._backward_hooks or {}),
        "held_after_error": held_after_error,
    }


@pytest.mark.parametrize("as_view", [False, True])
def test_a_parameter_a_module_returns_serves_its_caller(ranks, as_view):
    reference = bias_user(as_view)
    expected = _reference(lambda: bias_user(as_view), 4)
    with torch.no_grad():
        for param, value in zip(reference.parameters(), expected, strict=True):
            param.copy_(value)
        evaluated = reference(_batch(9)[0])
    for result in ranks(2).run(check_returned_parameter, as_view, timeout=TIMEOUT):
        assert _diff(result["params"], expected) < 1e-5
        assert (result["evaluated"] - evaluated).abs().max().item() < 1e-5
        # The root uses it (nothing hooked runs between), released when its forward ends.
        assert result["registered"] == [True] and result["released"]
        # The record restarted when the root took the unit over, the evaluation after it was
        # recorded and the next training step went on past it: no step left the record.
        assert result["misses"] == 0 and result["warnings"] == [], result["warnings"]
        assert result["held_after_error"] == 0
        assert result["hooks"] == 1  # the fetcher's own; none left by the forwards


# -- a weight gathered by its user, in forward and again in backward (TRL's fused LM head) ------


def _gathered_if_sharded(weight):
    """TRL's ``maybe_gather_lm_head_ctx``: gather unless it is whole already."""
    available = getattr(weight, "ds_status", None) in (None, ZeroParamStatus.AVAILABLE)
    return contextlib.nullcontext() if available else GatheredParameters([weight])


class _HeadProjection(torch.autograd.Function):
    """Reads the head's weight without calling the head, and gathers it again in backward."""

    @staticmethod
    def forward(ctx, hidden, weight):
        ctx.save_for_backward(hidden, weight)
        return hidden @ weight.t()

    @staticmethod
    def backward(ctx, grad):
        hidden, weight = ctx.saved_tensors
        with _gathered_if_sharded(weight):
            return grad @ weight, grad.t() @ hidden


class FusedHead(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.body = torch.nn.Linear(8, 16)
        self.head = torch.nn.Linear(16, 1, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        weight = self.head.weight
        with _gathered_if_sharded(weight):
            return _HeadProjection.apply(torch.tanh(self.body(x)), weight)


def fused_head() -> FusedHead:
    torch.manual_seed(0)
    return FusedHead()


def check_fused_head() -> tuple[list[torch.Tensor], tuple]:
    model = fused_head()
    engine, *_ = zerolap.initialize(model=model, config=_config())
    for step in range(3):
        _train_step(engine, step)
    params = _whole(model.parameters())
    # A gradient taken, not accumulated: the weight is back to its empty placeholder after.
    x, y = _batch(3)
    loss = torch.nn.functional.mse_loss(engine(_mine(x)), _mine(y))
    torch.autograd.grad(loss, [model.head.weight])
    return params, tuple(model.head.weight.shape)


def test_a_weight_its_user_gathers_in_backward_takes_its_gradient(ranks):
    # The gradient reaches autograd's accumulation after the backward's GatheredParameters
    # released the weight: torch shaped its copy after the released (empty) parameter and
    # failed ("The size of tensor a (0) must match the size of tensor b (16)").
    expected = _reference(fused_head, 3)
    for params, shape_after_grad in ranks(2).run(check_fused_head, timeout=TIMEOUT):
        assert _diff(params, expected) < 1e-5
        assert shape_after_grad == (0,)


# -- torch's non-reentrant activation checkpointing (transformers' default) --------------------


class Checkpointed(torch.nn.Module):
    """Blocks called through ``torch.utils.checkpoint`` as transformers' checkpointing layers
    call themselves: the recompute runs the blocks' hooks again, inside the backward."""

    def __init__(self, reentrant: bool) -> None:
        super().__init__()
        self.reentrant = reentrant
        self.embed = torch.nn.Linear(8, 8)  # so that the first block's input needs a gradient
        self.blocks = torch.nn.ModuleList(
            # Ending on the Linear, as a Transformer block's MLP does: its backward gathers
            # the weight before the recompute runs.
            torch.nn.Sequential(torch.nn.Tanh(), torch.nn.Linear(8, 8))
            for _ in range(3)
        )
        self.head = torch.nn.Linear(8, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.embed(x)
        for block in self.blocks:
            x = torch.utils.checkpoint.checkpoint(block, x, use_reentrant=self.reentrant)
        return self.head(x)


def checkpointed(reentrant: bool) -> Checkpointed:
    torch.manual_seed(0)
    return Checkpointed(reentrant)


def check_checkpointed(reentrant: bool) -> list[torch.Tensor]:
    model = checkpointed(reentrant)
    # Nothing kept gathered past its use: every unit is released as soon as it may be.
    config = _config(
        stage3_prefetch_bucket_size=0, stage3_max_reuse_distance=0, reduce_bucket_size=64
    )
    engine, *_ = zerolap.initialize(model=model, config=config)
    for step in range(3):
        _train_step(engine, step)
    return _whole(model.parameters())


@pytest.mark.parametrize("reentrant", [False, True])
def test_activation_checkpointing_recomputes_with_the_units_it_gathers(ranks, reentrant):
    # Non-reentrant: the recompute's forward hooks released the units its saved tensors read,
    # and the backward then failed ("setStorage: ... out of bounds for storage of size 0").
    expected = _reference(lambda: checkpointed(reentrant), 3)
    for params in ranks(2).run(check_checkpointed, reentrant, timeout=TIMEOUT):
        assert _diff(params, expected) < 1e-5


# -- a forward that raises ----------------------------------------------------------------------


def check_forward_that_raises(abort_at: int) -> float:
    """A loop that catches an error raised inside a forward (an out-of-memory one, say) and
    goes on: the modules the forward was inside kept their units gathered, which the step then
    made stale; the next forward must gather them afresh."""
    engine, *_ = zerolap.initialize(model=mlp(), config=_config())

    def boom(module, args):
        raise RuntimeError("out of memory, say")

    for step in range(4):
        if step == abort_at:
            handle = engine.module[2].register_forward_pre_hook(boom)
            with pytest.raises(RuntimeError, match="out of memory"):
                engine(_mine(_batch(step)[0]))
            handle.remove()
        _train_step(engine, step)
    got = _whole(engine.module.parameters())
    engine.destroy()
    return _diff(got, _reference(mlp, 4))


@pytest.mark.parametrize("abort_at", [0, 2])
def test_a_forward_that_raised_leaves_nothing_stale(ranks, abort_at):
    for diff in ranks(2).run(check_forward_that_raises, abort_at):
        assert diff < 1e-5, diff


class _Raises(torch.nn.Linear):
    def forward(self, x):
        raise RuntimeError("no kernel for this input, say")


class _Fallback(torch.nn.Module):
    """A block that catches its child's error and takes another path (a fallback): the
    child's forward never ends, the block's own does."""

    def __init__(self) -> None:
        super().__init__()
        self.fast = _Raises(8, 8)
        self.slow = torch.nn.Linear(8, 8)
        self.scale = torch.nn.Parameter(torch.ones(8))  # the block's own: held as it runs
        self.out = torch.nn.Linear(8, 1)

    def forward(self, x):
        try:
            h = self.fast(x)
        except RuntimeError:
            h = self.slow(x)
        return self.out(torch.tanh(h * self.scale))


def fallback() -> torch.nn.Module:
    torch.manual_seed(0)
    return _Fallback()


def check_caught_inside_a_forward() -> tuple[float, list[int]]:
    engine, *_ = zerolap.initialize(model=fallback(), config=_config())
    holds = []
    for step in range(3):
        _train_step(engine, step)
        holds.append(sum(engine.fetcher.store.holds))
    got = _whole(engine.module.parameters())
    engine.destroy()
    return _diff(got, _reference(fallback, 3)), holds


def test_an_error_caught_inside_a_forward_leaves_nothing_held(ranks):
    for diff, holds in ranks(2).run(check_caught_inside_a_forward):
        assert holds == [0, 0, 0], holds
        assert diff < 1e-5, diff
