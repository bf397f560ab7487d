"""``zerolap.zero.Init``: build a model already sharded, so no rank ever holds all of it.

Inside the context, a module's parameters are sharded as soon as the module is registered into
its parent (its ``__init__``, and so its own initialisation, has finished by then); parameters
of the root, registered by no one, are sharded on exit. So at most one module's parameters are
whole at a time. ``Module.apply`` is wrapped for the duration, gathering each module's
parameters around the function (rank 0's result is kept), so initialisers that run
``self.apply(init_fn)`` at the end of a model's ``__init__`` work.

Sharding is per parameter here (``InitPartition``): each parameter is broadcast from rank 0 (so
every rank starts from the same weights whatever its random state) and rank r keeps chunk r of
it, padded to a multiple of the world size. ``initialize`` later re-shards by module (see
``zero.sharded_params``), gathering one unit at a time.
"""

from __future__ import annotations

import contextlib
import json
from pathlib import Path

import torch

import zerolap.comm as dist
from zerolap.utils.logging import logger
from zerolap.zero.gathered import GatheredParameters
from zerolap.zero.status import ParamStatus, is_sharded, mark, unmark

__all__ = ["Init", "InitPartition"]

_DTYPES = {"fp32": torch.float32, "fp16": torch.float16, "bf16": torch.bfloat16}


class InitPartition:
    """Per-parameter shards (``param.ds_tensor``) made by ``zero.Init``."""

    def __init__(self, group, dtype: torch.dtype | None) -> None:
        self.group = group
        self.dtype = dtype
        self.world_size = dist.get_world_size(group)
        self.rank = dist.get_rank(group)
        self.src = dist.get_global_rank(group, 0) if group is not None else 0
        # Shards live where the group communicates: the rank's GPU under NCCL (as DeepSpeed
        # moves each parameter to its device), the host under gloo.
        self.device = dist.buffer_device(group)

    def _chunk_numel(self, numel: int) -> int:
        return -(-numel // self.world_size)

    def _own_chunk(self, flat: torch.Tensor) -> torch.Tensor:
        """This rank's chunk of ``flat``, zero-padded: the last ranks' chunks may run past it."""
        chunk = self._chunk_numel(flat.numel())
        lo = min(self.rank * chunk, flat.numel())
        hi = min(lo + chunk, flat.numel())
        out = torch.zeros(chunk, dtype=flat.dtype, device=flat.device)
        out[: hi - lo] = flat[lo:hi]
        return out

    def shard(self, param: torch.nn.Parameter) -> None:
        if is_sharded(param):
            return
        with torch.no_grad():
            full = param.data.to(device=self.device, dtype=self.dtype or param.dtype)
            if self.world_size > 1:
                full = full.contiguous()
                dist.broadcast(full, src=self.src, group=self.group)
            mark(param, ParamStatus.SHARDED, owner=self)
            param.ds_tensor = self._own_chunk(full.reshape(-1))
            param.data = torch.empty(0, dtype=full.dtype, device=full.device)

    def full_value(self, param: torch.nn.Parameter) -> torch.Tensor:
        """The whole parameter, gathered from every rank's shard (a collective)."""
        mine = param.ds_tensor
        gathered = torch.empty(mine.numel() * self.world_size, dtype=mine.dtype, device=mine.device)
        dist.all_gather_into_tensor(gathered, mine, group=self.group)
        return gathered[: param.ds_numel].view(param.ds_shape)

    def forget(self, param: torch.nn.Parameter) -> None:
        """Another owner took the parameter over."""
        del param.ds_tensor

    def unshard(self, param: torch.nn.Parameter) -> None:
        """Make ``param`` an ordinary whole tensor again (frozen parameters under stage 3)."""
        param.data = self.full_value(param)
        unmark(param)

    def hold(self, params: list[torch.nn.Parameter]) -> list[torch.nn.Parameter]:
        for param in params:
            param.data = self.full_value(param)
            param.ds_status = ParamStatus.AVAILABLE
        return params

    def unhold(self, params: list[torch.nn.Parameter], modifier_rank: int | None) -> None:
        with torch.no_grad():
            for param in params:
                if modifier_rank is not None:
                    if self.world_size > 1:
                        dist.broadcast(param.data, src=modifier_rank, group=self.group)
                    param.ds_tensor = self._own_chunk(param.data.reshape(-1))
                param.data = torch.empty(0, dtype=param.dtype, device=param.device)
                param.ds_status = ParamStatus.SHARDED


def _dtype_from_config(config) -> torch.dtype | None:
    if config is None:
        return None
    if isinstance(config, (str, Path)):
        config = json.loads(Path(config).read_text())
    if hasattr(config, "precision"):
        return _DTYPES[config.precision]
    # Read directly, not validated: the Hugging Face integration hands over its config before
    # filling in the "auto" placeholders, and an enabled "auto" is not a yes.
    for key, dtype in (
        ("bf16", torch.bfloat16),
        ("bfloat16", torch.bfloat16),
        ("fp16", torch.float16),
    ):
        if isinstance(config.get(key), dict) and config[key].get("enabled") is True:
            return dtype
    return None


class Init:
    """DeepSpeed's ``deepspeed.zero.Init``: ``with zerolap.zero.Init(config_dict_or_path=cfg):
    model = MyModel()`` builds ``model`` sharded across the data-parallel ranks;
    ``Init(module=model)`` shards an existing model at once."""

    def __init__(
        self,
        module: torch.nn.Module | None = None,
        data_parallel_group=None,
        mem_efficient_linear: bool = True,
        remote_device: str | None = None,
        pin_memory: bool = False,
        config_dict_or_path=None,
        config=None,
        enabled: bool = True,
        dtype: torch.dtype | None = None,
        mpu=None,
    ) -> None:
        if remote_device not in (None, "cpu", "cuda", "nvme"):
            raise ValueError(
                f"zero.Init(remote_device={remote_device!r}): must be cpu, cuda or nvme"
            )
        if remote_device == "nvme":
            # Said, not ignored: shards are built in memory and go to disk with the engine.
            logger.info(
                "zero.Init(remote_device='nvme'): parameter shards are built in memory and "
                "moved to swap files when initialize() builds the engine with "
                "offload_param.device 'nvme'"
            )
        if mpu is not None:
            raise ValueError("zero.Init(mpu=...): model parallelism is not supported by zerolap")
        self.enabled = enabled
        self._hooks: list = []
        self._registered: list[torch.nn.Module] = []
        self._apply = None
        if not enabled:
            return
        if not dist.is_initialized():
            dist.init_distributed(verbose=False)
        source = config_dict_or_path if config_dict_or_path is not None else config
        self.partition = InitPartition(data_parallel_group, dtype or _dtype_from_config(source))
        if module is not None:
            self._shard_tree(module)

    def _shard_tree(self, module: torch.nn.Module) -> None:
        for param in module.parameters():
            self.partition.shard(param)

    def __enter__(self):
        if not self.enabled:
            return self
        nn_module = torch.nn.modules.module
        self._hooks = [
            nn_module.register_module_module_registration_hook(
                lambda parent, name, child: self._shard_tree(child) if child is not None else None
            ),
            nn_module.register_module_parameter_registration_hook(
                lambda module, name, param: self._registered.append(module)
            ),
        ]
        self._apply = torch.nn.Module.apply
        torch.nn.Module.apply = _gathered_apply
        return self

    def __exit__(self, *exc) -> None:
        if not self.enabled:
            return
        for hook in self._hooks:
            hook.remove()
        torch.nn.Module.apply = self._apply
        if exc[0] is None:
            for module in self._registered:
                self._shard_tree(module)
        self._hooks, self._registered = [], []


def _gathered_apply(self: torch.nn.Module, fn):
    """``Module.apply`` with each module's sharded parameters whole while ``fn`` sees them;
    rank 0's changes are kept."""
    for child in self.children():
        child.apply(fn)
    sharded = [p for p in self.parameters(recurse=False) if is_sharded(p)]
    context = GatheredParameters(sharded, modifier_rank=0) if sharded else contextlib.nullcontext()
    with context:
        fn(self)
    return self
