"""Data parallelism under `torchrun`: process group, model wrapping, full state dicts, rank 0 writes.

One process per device. `torchrun --nproc_per_node N -m owai ...` sets RANK/WORLD_SIZE/LOCAL_RANK;
`init()` reads them (NCCL on CUDA, gloo on CPU). A single process (no torchrun) is the same code
path with world_size 1, so nothing else in owai branches on "distributed or not" beyond
`is_main()` (only rank 0 writes files) and the helpers here.

Strategies (config `train.parallel`):
    ddp    DistributedDataParallel: every rank holds the whole model; gradients are all-reduced.
    fsdp   FSDP2 `fully_shard` per block, then the root: parameters, gradients and optimizer state
           are sharded, for models that do not fit on one device.
Checkpoints always hold the *full* (unsharded) model and optimizer state, gathered to rank 0 on
save and broadcast from rank 0 on load, so a checkpoint written by 8 FSDP ranks resumes on 1 process
and vice versa, in the one checkpoint format (owai/checkpoint.py).
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from owai.errors import OwaiError

STRATEGIES = ("ddp", "fsdp")


@dataclass(frozen=True)
class World:
    rank: int = 0
    world_size: int = 1
    local_rank: int = 0

    @property
    def is_main(self) -> bool:
        return self.rank == 0


def world() -> World:
    """This process's place in the job (rank 0 of 1 outside torchrun)."""
    if dist.is_available() and dist.is_initialized():
        return World(dist.get_rank(), dist.get_world_size(), int(os.environ.get("LOCAL_RANK", 0)))
    return World()


def is_main() -> bool:
    return world().is_main


def launched_by_torchrun() -> bool:
    return int(os.environ.get("WORLD_SIZE", "1")) > 1


def init() -> World:
    """Join the torchrun job if there is one (idempotent); returns this process's World.

    gloo serves CPU tensors and, when CUDA is present, NCCL serves CUDA tensors."""
    if not launched_by_torchrun() or dist.is_initialized():
        return world()
    backend = "gloo"
    if torch.cuda.is_available():
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", 0)))
        backend = "cpu:gloo,cuda:nccl"
    try:
        dist.init_process_group(backend=backend)
    except (RuntimeError, ValueError) as e:
        raise OwaiError(f"cannot join the torchrun job ({backend}): {str(e).splitlines()[0]}") from None
    return world()


def device_for(device: torch.device) -> torch.device:
    """Under torchrun on CUDA each rank uses its LOCAL_RANK device."""
    if device.type == "cuda" and launched_by_torchrun():
        return torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0)))
    return device


def broadcast_object(obj: Any) -> Any:
    """Rank 0's `obj` on every rank (e.g. the run directory rank 0 created)."""
    if not (dist.is_available() and dist.is_initialized()):
        return obj
    box = [obj]
    dist.broadcast_object_list(box, src=0)
    return box[0]


def mean_across_ranks(value: float, device: torch.device) -> float:
    """The mean of a scalar over ranks (for logging; a no-op in one process)."""
    if not (dist.is_available() and dist.is_initialized()):
        return value
    t = torch.tensor([value], dtype=torch.float64, device=device)
    dist.all_reduce(t)
    return t.item() / dist.get_world_size()


def barrier() -> None:
    if dist.is_available() and dist.is_initialized():
        dist.barrier()


def shutdown() -> None:
    if dist.is_available() and dist.is_initialized():
        dist.destroy_process_group()


class Parallel:
    """A model as the training loop sees it: the module to call, and its full state dicts.

    `forward_module` is what a loss function calls (the DDP wrapper, or the FSDP-sharded model);
    `module` is the plain model (for eval, generation, save_pretrained). Outside torchrun both are
    the same object and the state dicts are the usual ones.
    """

    def __init__(self, module: torch.nn.Module, strategy: str = "ddp", blocks: list[torch.nn.Module] | None = None) -> None:
        if strategy not in STRATEGIES:
            raise OwaiError(f"train.parallel must be one of {', '.join(STRATEGIES)}, got {strategy!r}")
        self.module = module
        self.strategy = strategy
        self.world = world()
        self.forward_module: torch.nn.Module = module
        if self.world.world_size > 1:
            if strategy == "ddp":
                from torch.nn.parallel import DistributedDataParallel

                device_ids = [module_device(module).index] if module_device(module).type == "cuda" else None
                self.forward_module = DistributedDataParallel(module, device_ids=device_ids)
            else:
                from torch.distributed.fsdp import fully_shard

                for block in blocks or []:
                    fully_shard(block)
                fully_shard(module)

    @property
    def sharded(self) -> bool:
        return self.world.world_size > 1

    @contextlib.contextmanager
    def no_sync(self, skip: bool) -> Iterator[None]:
        """Skip the gradient all-reduce on micro-batches before the last one of an accumulation."""
        fm = self.forward_module
        if skip and self.sharded and self.strategy == "ddp":
            with fm.no_sync():  # type: ignore[operator]
                yield
        elif self.sharded and self.strategy == "fsdp":
            fm.set_requires_gradient_sync(not skip)  # type: ignore[operator]
            yield
        else:
            yield

    def state_dict(self, optimizer: torch.optim.Optimizer) -> tuple[dict[str, Any], dict[str, Any]]:
        """(model, optimizer) full state dicts on CPU, optimizer state keyed by parameter name, the same
        layout for 1 process, DDP and FSDP (gathering shards is a collective: call on every rank)."""
        from torch.distributed.checkpoint.state_dict import StateDictOptions, get_state_dict

        opts = StateDictOptions(full_state_dict=True, cpu_offload=True)
        return get_state_dict(self.module, optimizer, options=opts)

    def load_state_dict(self, optimizer: torch.optim.Optimizer, model_state: dict[str, Any], optim_state: dict[str, Any]) -> None:
        from torch.distributed.checkpoint.state_dict import StateDictOptions, set_state_dict

        opts = StateDictOptions(full_state_dict=True)
        set_state_dict(self.module, optimizer, model_state_dict=model_state, optim_state_dict=optim_state, options=opts)


def unsharded(parallel: Parallel, rebuild: Callable[[], torch.nn.Module]) -> torch.nn.Module:
    """The trained model as one plain module on every rank, for evaluation and save_pretrained.

    DDP and single processes already hold it; FSDP gathers the full weights (a collective) into a
    fresh copy from `rebuild()`, so nothing after training depends on collectives."""
    if not (parallel.sharded and parallel.strategy == "fsdp"):
        return parallel.module
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

    full = get_model_state_dict(parallel.module, options=StateDictOptions(full_state_dict=True))
    fresh = rebuild()
    fresh.load_state_dict({k: v.to(module_device(fresh)) for k, v in full.items()})
    return fresh


def module_device(module: torch.nn.Module) -> torch.device:
    return next(module.parameters()).device
