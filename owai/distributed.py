"""Data parallelism under `torchrun`: process group, model wrapping, full state dicts, rank 0 writes.

One process per device. `torchrun --nproc_per_node N -m owai ...` sets RANK/WORLD_SIZE/LOCAL_RANK;
`init()` reads them (NCCL on CUDA, gloo on CPU). A single process (no torchrun) is the same code
path with world_size 1, so nothing else in owai branches on "distributed or not" beyond
`is_main()` (only rank 0 writes files) and the helpers here.

Strategies (config `train.parallel`):
    ddp    DistributedDataParallel: every rank holds the whole model; gradients are all-reduced.
    fsdp   FSDP2 `fully_shard` per block, then the root: parameters, gradients and optimizer state
           are sharded, for models that do not fit on one device.
Checkpoints (owai/checkpoint.py, one format) come in two variants, both of which resume on any
world size: *full* (ddp and single processes: the whole model and optimizer state gathered to rank 0
on save and broadcast from rank 0 on load) and *sharded* (fsdp: every rank writes its own shards with
torch.distributed.checkpoint, `sharded_state`, and loads whatever slices it now owns).

Models too large for one device are built with `Parallel.from_meta`: the model is constructed on the
meta device (no memory), sharded, then materialised shard by shard with the values a normal build
would have given (see `record_build` / `materialize`), so no rank ever holds the whole model. The
same call also applies bf16 mixed precision (FSDP2 `MixedPrecisionPolicy`), activation checkpointing
and torch.compile per block.
"""

from __future__ import annotations

import contextlib
import os
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from owai.errors import OwaiError, one_line
from owai.runtime import AUTOCAST_DTYPES

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


def launch_rank() -> int:
    """This process's rank as torchrun set it (RANK; 0 outside torchrun), known before `init`."""
    return int(os.environ.get("RANK", "0")) if launched_by_torchrun() else 0


def launch_world_size() -> int:
    """The number of ranks torchrun started (WORLD_SIZE; 1 outside torchrun), known before `init`."""
    return max(1, int(os.environ.get("WORLD_SIZE", "1")))


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
        raise OwaiError(f"cannot join the torchrun job ({backend}): {one_line(e)}") from None
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


def gather_objects(obj: Any) -> list[Any]:
    """Every rank's `obj`, in rank order, on every rank (`[obj]` in one process)."""
    if not (dist.is_available() and dist.is_initialized()):
        return [obj]
    out: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(out, obj)
    return out


def gather_tensors(tensor: torch.Tensor) -> torch.Tensor:
    """Every rank's `tensor` concatenated along its first dimension in rank order, on every rank (a
    0-d tensor counts as one element: W ranks' scalars make a tensor of W); the tensor itself, as
    one element at least, in one process. What lm-evaluation-harness's `LM.all_gather` returns."""
    one = tensor.reshape(1) if tensor.dim() == 0 else tensor.contiguous()
    if not (dist.is_available() and dist.is_initialized()):
        return one
    parts = [torch.empty_like(one) for _ in range(dist.get_world_size())]
    dist.all_gather(parts, one)
    return torch.cat(parts)


def sum_across_ranks(values: list[float], device: torch.device) -> list[float]:
    """Each value summed over ranks (exact totals for a mean over every rank's items; a no-op in
    one process)."""
    if not (dist.is_available() and dist.is_initialized()):
        return list(values)
    t = torch.tensor(values, dtype=torch.float64, device=device)
    dist.all_reduce(t)
    return t.tolist()


def on_every_rank(flag: bool, device: torch.device) -> bool:
    """Whether `flag` holds on every rank (`flag` itself in one process): what the ranks agree on
    before one of them may skip a step the others take (under FSDP a forward pass is a collective
    that every rank enters)."""
    if not (dist.is_available() and dist.is_initialized()):
        return flag
    return sum_across_ranks([1.0 if flag else 0.0], device)[0] == world().world_size


def mean_across_ranks(value: float, device: torch.device) -> float:
    """The mean of a scalar over ranks (for logging; a no-op in one process)."""
    return sum_across_ranks([value], device)[0] / world().world_size


def barrier() -> None:
    if dist.is_available() and dist.is_initialized():
        dist.barrier()


def shutdown() -> None:
    """Leave the torchrun job at its end, as torch asks (`destroy_process_group`): first a barrier,
    so that no rank closes its connections while a peer's last collective is still in flight.
    Only on success: after an error the rank exits non-zero and torchrun stops the others (a
    collective teardown beside a failed peer would wait forever)."""
    if dist.is_available() and dist.is_initialized():
        barrier()
        dist.destroy_process_group()


def lost_peer(error: BaseException) -> bool:
    """Whether `error` is this rank losing its peers rather than an error of its own: torch's
    distributed errors (NCCL's `DistBackendError`, the store's and network's) and gloo's transport
    errors, plain RuntimeErrors ("[.../gloo/transport/tcp/pair.cc:553] Connection closed by peer ...
    typically caused by a remote worker crashing", "Connection reset by peer", a receive timed out).
    Under torchrun that is what every other rank sees when one rank fails: the symptom, not the cause."""
    if isinstance(error, dist.DistError):
        return True
    return isinstance(error, RuntimeError) and "gloo/transport/" in str(error)


def record_for_torchrun(message: str) -> None:
    """Write this rank's error where torchrun looks for it (TORCHELASTIC_ERROR_FILE, which torchrun
    sets for each rank; nothing outside torchrun), in the format of torch.distributed.elastic's
    `record` decorator: torchrun's closing "Root Cause (first observed failure)" report then shows
    `message` instead of "To enable traceback see: https://pytorch.org/docs/stable/elastic/errors.html".
    The one line owai prints, no traceback. Only for an error of the rank's own (not `lost_peer`, not
    a stop): torchrun takes the earliest file as the root cause."""
    path = os.environ.get("TORCHELASTIC_ERROR_FILE")
    if not path:
        return
    from owai.io import atomic_write_json

    record = {"message": {"message": message, "extraInfo": {"py_callstack": message, "timestamp": str(int(time.time()))}}}
    with contextlib.suppress(OwaiError):  # torchrun's report is a courtesy: the rank's own line is printed anyway
        atomic_write_json(Path(path), record)


MIXED_PRECISIONS = tuple(AUTOCAST_DTYPES)  # bfloat16, float16


class Parallel:
    """A model as the training loop sees it: the module to call, and its state dicts.

    `forward_module` is what a loss function calls (the DDP wrapper, or the FSDP-sharded model);
    `module` is the plain model (for eval, generation, save_pretrained). Outside torchrun both are
    the same object and the state dicts are the usual ones.

    Per block (`blocks`, e.g. `owai.models.lm.blocks(model)`), in this order: activation
    checkpointing (the block's activations are recomputed in the backward pass instead of being
    kept; composable, so parameter names do not change), torch.compile (`module.compile()`, in
    place, names unchanged) and, for fsdp under torchrun, `fully_shard` (then the root).
    `mixed_precision` ("bfloat16" / "float16", fsdp only) computes in that dtype with fp32 master
    weights, optimizer state and gradient reduction (`MixedPrecisionPolicy(param_dtype, reduce_dtype=
    float32)`); a single process or DDP gets the same effect from the loop's autocast
    (`LoopConfig.precision`). `module` may be on the meta device (see `from_meta`).
    """

    def __init__(
        self,
        module: torch.nn.Module,
        strategy: str = "ddp",
        blocks: list[torch.nn.Module] | None = None,
        *,
        mixed_precision: str | None = None,
        activation_checkpointing: bool = False,
        compile_blocks: bool = False,
        device: torch.device | None = None,
    ) -> None:
        if strategy not in STRATEGIES:
            raise OwaiError(f"train.parallel must be one of {', '.join(STRATEGIES)}, got {strategy!r}")
        if mixed_precision not in (None, "float32", *MIXED_PRECISIONS):
            raise OwaiError(f"mixed precision must be one of float32, {', '.join(MIXED_PRECISIONS)}, got {mixed_precision!r}")
        self.module = module
        self.strategy = strategy
        self.world = world()
        self.forward_module: torch.nn.Module = module
        if activation_checkpointing:
            from torch.distributed._composable import checkpoint

            for block in blocks or []:
                checkpoint(block)
        if compile_blocks:
            for block in blocks or []:
                block.compile()
        if self.world.world_size > 1:
            device = device or module_device(module)
            if strategy == "ddp":
                if device.type == "meta":
                    raise OwaiError("ddp needs a materialised model (Parallel.from_meta materialises it first)")
                from torch.nn.parallel import DistributedDataParallel

                device_ids = [device.index] if device.type == "cuda" else None
                self.forward_module = DistributedDataParallel(module, device_ids=device_ids)
            else:
                from torch.distributed.device_mesh import init_device_mesh
                from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

                mesh_type = device.type if device.type != "meta" else ("cuda" if torch.cuda.is_available() else "cpu")
                mesh = init_device_mesh(mesh_type, (self.world.world_size,))
                kwargs: dict[str, Any] = {"mesh": mesh}
                if mixed_precision in MIXED_PRECISIONS:
                    kwargs["mp_policy"] = MixedPrecisionPolicy(param_dtype=AUTOCAST_DTYPES[mixed_precision], reduce_dtype=torch.float32)
                for block in blocks or []:
                    fully_shard(block, **kwargs)
                fully_shard(module, **kwargs)

    @classmethod
    def from_meta(
        cls,
        build: Callable[[], torch.nn.Module],
        strategy: str = "fsdp",
        *,
        device: torch.device,
        blocks_of: Callable[[torch.nn.Module], list[torch.nn.Module]] | None = None,
        seed: int | None = None,
        mixed_precision: str | None = None,
        activation_checkpointing: bool = False,
        compile_blocks: bool = False,
    ) -> "Parallel":
        """Build `build()` without ever holding the whole model on one rank, with the values a
        normal build gives: `torch.manual_seed(seed); build().to(device)` (`seed` None: from the
        current RNG state, which is then advanced as a normal build would advance it).

        `build()` runs on the meta device while `record_build` records its initialisation
        (constructor defaults and `post_init`); for fsdp under torchrun the meta model is sharded
        (`blocks_of(model)` per block, then the root) and `to_empty` allocates only this rank's
        shards; `materialize` then replays the recorded initialisation on the CPU one tensor at a
        time and copies each rank's slice into its shard. Peak extra memory: one parameter (plus
        the transient tensors of its initialisation). Every rank replays the whole random stream,
        so this costs the CPU time of a normal initialisation, not its memory. With ddp or one
        process the model is materialised whole (it fits, by assumption) and wrapped as usual.
        `build` must not reseed the global RNG itself: pass `seed`."""
        if strategy not in STRATEGIES:
            raise OwaiError(f"train.parallel must be one of {', '.join(STRATEGIES)}, got {strategy!r}")
        model, trace = record_build(build, seed)
        blocks = blocks_of(model) if blocks_of is not None else []
        options = dict(mixed_precision=mixed_precision, activation_checkpointing=activation_checkpointing,
                       compile_blocks=compile_blocks)
        if strategy == "fsdp" and world().world_size > 1:
            parallel = cls(model, strategy, blocks, device=device, **options)
            materialize(model, trace, device)
            return parallel
        materialize(model, trace, device)
        return cls(model, strategy, blocks, **options)

    @property
    def sharded(self) -> bool:
        return self.world.world_size > 1

    @property
    def fsdp(self) -> bool:
        """The parameters are FSDP shards (DTensors) rather than whole tensors on every rank."""
        return self.sharded and self.strategy == "fsdp"

    @contextlib.contextmanager
    def no_sync(self, skip: bool) -> Iterator[None]:
        """DDP: skip the gradient all-reduce on micro-batches before the last one of an accumulation
        (each rank holds whole gradients anyway). FSDP reduce-scatters after every micro-batch and
        accumulates the sharded gradients, as torchtitan does: FSDP2 without gradient sync keeps every
        parameter's unsharded gradient (in fp32, its reduce dtype) until the last micro-batch, the
        whole model's on every rank (40 GB for v2 large, beside the 44 GiB its plan holds on 8 GPUs),
        which sharding was there to avoid; the reduce-scatter of each micro-batch overlaps its backward pass."""
        if skip and self.sharded and self.strategy == "ddp":
            with self.forward_module.no_sync():  # type: ignore[operator]
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
        """Load `state_dict`'s layout back (a collective under torchrun)."""
        _load_state(self.module, optimizer, model_state, optim_state, full=True)


def _load_state(module: torch.nn.Module, optimizer: torch.optim.Optimizer, model_state: dict[str, Any],
                optim_state: dict[str, Any], full: bool) -> None:
    """Load model state strictly and optimizer state allowing parameters without any: torch's
    optimizers make a parameter's state at the first step that reads its gradient, so a checkpoint
    written before a parameter had one (Memory Mosaics v2's long-term memory while the context is
    no longer than the short window) has none for it, and the resumed run, like the uninterrupted
    one, makes it when the gradient comes. torch's loader first gives every parameter the state of
    one zero-gradient step (Adam's `step` 1) and keeps it where the checkpoint has none: that state
    is dropped, or the parameter's first updates would differ (Adam's bias correction counts it)."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, set_model_state_dict, set_optimizer_state_dict

    set_model_state_dict(module, model_state, options=StateDictOptions(full_state_dict=full))
    set_optimizer_state_dict(module, optimizer, optim_state, options=StateDictOptions(full_state_dict=full, strict=False))
    names = {param: name for name, param in module.named_parameters()}
    saved = optim_state.get("state", {})
    if set(saved) <= set(names.values()):  # keyed by parameter name, as get_state_dict writes
        for param in [p for p in optimizer.state if p in names and names[p] not in saved]:
            del optimizer.state[param]


def sharded_state(module: torch.nn.Module, optimizer: torch.optim.Optimizer) -> tuple[dict[str, Any], dict[str, Any]]:
    """(model, optimizer) state dicts as this rank holds them, keyed by parameter name: DTensor
    shards for an FSDP model, whole tensors otherwise; nothing is gathered. The tensors alias the
    live ones, so `torch.distributed.checkpoint` can save from and load into them (then call
    `load_sharded_state`). An optimizer that has not stepped yet gets its state initialised (a step
    with zero gradients and lr 0), so there is something to load into."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_state_dict

    return get_state_dict(module, optimizer, options=StateDictOptions(full_state_dict=False))


def load_sharded_state(module: torch.nn.Module, optimizer: torch.optim.Optimizer, model_state: dict[str, Any], optim_state: dict[str, Any]) -> None:
    """Put state dicts of `sharded_state`'s layout (after `torch.distributed.checkpoint.load` filled
    them) back into the model and optimizer."""
    _load_state(module, optimizer, model_state, optim_state, full=False)


def full_state_on_rank0(parallel: Parallel) -> dict[str, torch.Tensor] | None:
    """An FSDP model's whole state dict on rank 0's CPU (None on the other ranks), gathered one
    parameter at a time: what save_pretrained writes after an FSDP run. No rank holds the whole model
    on its device; rank 0's host memory holds it once (fp32: 4 bytes per parameter). A collective."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

    full = get_model_state_dict(parallel.module, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
    return full if is_main() else None


def module_device(module: torch.nn.Module) -> torch.device:
    return next(module.parameters()).device


# -- building on the meta device ----------------------------------------------------------------
#
# A normal build (`torch.manual_seed(s); model = build()`) initialises every tensor on the CPU from
# the global random stream: the constructors' default inits, then (Hugging Face) `post_init`, which
# overwrites most of them. To give a sharded model exactly those values without building it whole,
# `record_build` runs `build()` on the meta device under a dispatch mode that records every aten op
# touching a meta tensor; `materialize` then replays the record on the CPU in order: random ops
# whose result is overwritten later run on a scratch tensor (only to advance the random stream
# exactly as the normal build did), the ops that produce a final value run for real, and as soon
# as a parameter's last op has run its value is copied into the model (into this rank's shard) and
# freed. Which ops matter is found by a backward pass over the record (an op that overwrites a
# whole tensor - normal_, uniform_, fill_, zero_, copy_ - ends the dependence on its older values).


def _storage_key(t: torch.Tensor) -> int:
    return t.untyped_storage()._cdata


_OVERWRITE = {"uniform_", "normal_", "fill_", "zero_", "random_", "exponential_", "geometric_", "log_normal_",
              "cauchy_", "bernoulli_", "copy_"}


def _covers_storage(t: torch.Tensor) -> bool:
    """`t` spans its whole storage, each element once (so writing all of `t` overwrites the storage)."""
    if t.storage_offset() != 0 or t.numel() * t.element_size() != t.untyped_storage().nbytes():
        return False
    dims = sorted((st, n) for st, n in zip(t.stride(), t.shape) if n != 1)
    expected = 1
    for st, n in dims:
        if st != expected:
            return False
        expected *= n
    return True


@dataclass
class _Op:
    func: Any
    args: tuple
    kwargs: dict
    out: Any
    seeded: bool  # draws from a random generator
    reads: set[int]  # storages whose values it reads
    writes: set[int]  # storages it mutates in part (reading the rest)
    overwrites: set[int]  # storages it writes whole, without reading (fresh outputs included)
    fresh: list[torch.Tensor]  # its outputs that own a new storage


class _Recorder:
    """A TorchDispatchMode (created lazily: torch.utils._python_dispatch is private API) that runs
    every op and records those touching a meta tensor."""

    def __init__(self) -> None:
        from torch.utils._python_dispatch import TorchDispatchMode
        from torch.utils._pytree import tree_leaves

        ops: list[_Op] = []
        self.ops = ops

        class Mode(TorchDispatchMode):
            def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # noqa: ANN001
                kwargs = kwargs or {}
                out = func(*args, **kwargs)
                leaves = [x for x in tree_leaves((args, kwargs, out)) if isinstance(x, torch.Tensor)]
                if any(x.is_meta for x in leaves):
                    ops.append(_describe(func, args, kwargs, out, tree_leaves))
                return out

        self.mode = Mode()


def _describe(func: Any, args: tuple, kwargs: dict, out: Any, tree_leaves: Callable) -> _Op:
    schema = func._schema
    positional = [a for a in schema.arguments if not a.kwarg_only]
    bound = [(a, args[i]) for i, a in enumerate(positional) if i < len(args)]
    bound += [(a, kwargs[a.name]) for a in schema.arguments if a.name in kwargs]
    overwrite_op = schema.name.split("::")[-1] in _OVERWRITE
    reads: set[int] = set()
    writes: set[int] = set()
    overwrites: set[int] = set()
    for arg, value in bound:
        tensors = [t for t in tree_leaves(value) if isinstance(t, torch.Tensor) and t.is_meta]
        is_write = arg.alias_info is not None and arg.alias_info.is_write
        for t in tensors:
            key = _storage_key(t)
            if is_write and (overwrite_op or arg.name == "out") and _covers_storage(t):
                overwrites.add(key)
            elif is_write:
                writes.add(key)
                reads.add(key)
            else:
                reads.add(key)
    outs = out if isinstance(out, (tuple, list)) else (out,)
    fresh = []
    for ret, value in zip(schema.returns, outs):
        if ret.alias_info is None:
            fresh += [t for t in tree_leaves(value) if isinstance(t, torch.Tensor) and t.is_meta]
    overwrites |= {_storage_key(t) for t in fresh}
    seeded = torch.Tag.nondeterministic_seeded in func.tags
    return _Op(func, args, kwargs, out, seeded, reads, writes, overwrites, fresh)


@dataclass
class BuildTrace:
    """What `record_build` saw: the ops, the random state they start from, and the final tensors."""

    ops: list[_Op]
    rng_state: torch.Tensor | None  # the state to replay from (None: the current one, then advanced)
    finals: dict[int, list[tuple[str, torch.Tensor]]]  # storage -> [(name, meta tensor)] of the model


@contextlib.contextmanager
def _hf_initialises_on_meta() -> Iterator[None]:
    """Hugging Face skips `post_init`'s weight initialisation under a meta device context (nothing
    to initialise); the record needs those ops, in the order a normal build runs them."""
    import sys

    mu = sys.modules.get("transformers.modeling_utils")
    original = getattr(mu, "get_torch_context_manager_or_global_device", None)
    if original is None:
        yield
        return
    mu.get_torch_context_manager_or_global_device = lambda: None  # type: ignore[union-attr]
    try:
        yield
    finally:
        mu.get_torch_context_manager_or_global_device = original  # type: ignore[union-attr]


# torch.nn.init functions that return at once for a meta tensor (in Python, before any op): under
# the recorder they record themselves as one op, replayed by calling them on the CPU tensor.
# (`_no_grad_trunc_normal_` serves every trunc_normal_; a name imported from torch.nn.init before
# the build, e.g. `from torch.nn.init import orthogonal_`, is not seen.)
_META_SKIPPING_INITS = ("_no_grad_trunc_normal_", "orthogonal_", "sparse_", "dirac_")


@contextlib.contextmanager
def _record_meta_skipping_inits(ops: list[_Op]) -> Iterator[None]:
    import sys

    import torch.nn.init as nn_init

    def recording(original: Callable) -> Callable:
        def init(tensor: torch.Tensor, *args: Any, **kwargs: Any) -> Any:
            if not (isinstance(tensor, torch.Tensor) and tensor.is_meta):
                return original(tensor, *args, **kwargs)
            key = _storage_key(tensor)
            whole = _covers_storage(tensor)
            ops.append(_Op(original, (tensor, *args), kwargs, tensor, True, set() if whole else {key},
                           set() if whole else {key}, {key} if whole else set(), []))
            return tensor

        return init

    tables: list[Any] = [vars(nn_init)]
    hf = sys.modules.get("transformers.initialization")
    if isinstance(getattr(hf, "TORCH_INIT_FUNCTIONS", None), dict):
        tables.append(hf.TORCH_INIT_FUNCTIONS)  # type: ignore[union-attr]
    saved = [(table, name, table[name]) for table in tables for name in _META_SKIPPING_INITS if name in table]
    for table, name, original in saved:
        table[name] = recording(original)
    try:
        yield
    finally:
        for table, name, original in saved:
            table[name] = original


def record_build(build: Callable[[], torch.nn.Module], seed: int | None = None) -> tuple[torch.nn.Module, BuildTrace]:
    """Run `build()` on the meta device, recording its initialisation: (meta model, trace)."""
    with contextlib.suppress(ImportError):  # loaded before `build` runs, so the patch below applies
        import transformers.modeling_utils  # noqa: F401

    with torch.random.fork_rng(devices=[]):
        if seed is not None:
            torch.manual_seed(seed)
        start = torch.get_rng_state()
        recorder = _Recorder()
        with _hf_initialises_on_meta(), _record_meta_skipping_inits(recorder.ops), torch.device("meta"), recorder.mode:
            model = build()
        if not torch.equal(start, torch.get_rng_state()):
            raise OwaiError("cannot build this model on the meta device: its construction draws random numbers on the CPU")
    finals: dict[int, list[tuple[str, torch.Tensor]]] = {}
    named = list(model.named_parameters(remove_duplicate=False)) + list(model.named_buffers(remove_duplicate=False))
    for name, t in named:
        if not t.is_meta:
            raise OwaiError(f"cannot build this model on the meta device: {name} was created on {t.device}")
        finals.setdefault(_storage_key(t), []).append((name, t))
    return model, BuildTrace(recorder.ops, start if seed is not None else None, finals)


def _on_cpu(t: torch.Tensor, storages: dict[int, Any]) -> torch.Tensor:
    """The CPU tensor standing for meta tensor `t` (same storage layout), allocating its storage."""
    key = _storage_key(t)
    if key not in storages:
        storages[key] = torch.empty(t.untyped_storage().nbytes(), dtype=torch.uint8).untyped_storage()
    return torch.empty(0, dtype=t.dtype).set_(storages[key], t.storage_offset(), t.shape, t.stride())


def _adopt(meta: torch.Tensor, real: torch.Tensor, storages: dict[int, Any]) -> None:
    """Let the CPU result `real` of an op stand for its meta output `meta` (copied only if the
    layouts differ)."""
    same = (real.untyped_storage().nbytes() == meta.untyped_storage().nbytes() and real.dtype == meta.dtype
            and real.storage_offset() == meta.storage_offset() and real.stride() == meta.stride())
    key = _storage_key(meta)
    if same and key not in storages:
        storages[key] = real.untyped_storage()
    else:
        _on_cpu(meta, storages).copy_(real)


def _scratch(t: torch.Tensor) -> torch.Tensor:
    return torch.zeros(t.untyped_storage().nbytes() // t.element_size(), dtype=t.dtype).as_strided(t.shape, t.stride(), t.storage_offset())


def _on_cpu_args(op: _Op, convert: Callable[[torch.Tensor], torch.Tensor]) -> tuple[tuple, dict]:
    from torch.utils._pytree import tree_map

    def leaf(x: Any) -> Any:
        if isinstance(x, torch.Tensor) and x.is_meta:
            return convert(x)
        if isinstance(x, torch.device) and x.type == "meta":
            return torch.device("cpu")
        return x

    return tree_map(leaf, op.args), tree_map(leaf, op.kwargs)


def materialize(model: torch.nn.Module, trace: BuildTrace, device: torch.device) -> None:
    """Allocate `model`'s meta tensors on `device` (for an FSDP model: this rank's shards) and fill
    them with the values of a normal build, by replaying `trace` (see `record_build`)."""
    from torch.utils._pytree import tree_leaves

    tied = _tied_groups(model)
    model.to_empty(device=device)
    _retie(model, tied)
    ops = trace.ops
    needed = set(trace.finals)
    run = [False] * len(ops)
    for i in range(len(ops) - 1, -1, -1):  # which ops a final value depends on
        op = ops[i]
        if (op.writes | op.overwrites) & needed:
            run[i] = True
            needed -= op.overwrites
            needed |= op.reads
    last: dict[int, int] = {}
    for i, op in enumerate(ops):
        if run[i]:
            for key in op.reads | op.writes | op.overwrites:
                last[key] = i
    missing = [names[0][0] for key, names in trace.finals.items() if key not in last]
    if missing:
        raise OwaiError(f"cannot build this model on the meta device: {missing[0]} has no recorded initialisation")
    done_at: dict[int, list[int]] = {}
    for key, i in last.items():
        done_at.setdefault(i, []).append(key)
    storages: dict[int, Any] = {}
    with contextlib.ExitStack() as stack:
        stack.enter_context(torch.no_grad())
        if trace.rng_state is not None:
            stack.enter_context(torch.random.fork_rng(devices=[]))
            torch.set_rng_state(trace.rng_state)
        for i, op in enumerate(ops):
            if run[i]:
                args, kwargs = _on_cpu_args(op, lambda t: _on_cpu(t, storages))
                out = op.func(*args, **kwargs)
                results = [x for x in tree_leaves(out) if isinstance(x, torch.Tensor)]
                metas = [x for x in tree_leaves(op.out) if isinstance(x, torch.Tensor)]
                for meta_out in op.fresh:
                    real = results[next(j for j, m in enumerate(metas) if m is meta_out)]
                    _adopt(meta_out, real, storages)
                for key in done_at.get(i, []):
                    for name, meta in trace.finals.get(key, []):
                        _assign(model, name, _on_cpu(meta, storages), device)
                    storages.pop(key, None)
            elif op.seeded:  # advance the random stream exactly as the normal build did
                written = op.writes | op.overwrites
                args, kwargs = _on_cpu_args(
                    op, lambda t: _scratch(t) if _storage_key(t) in written or _storage_key(t) not in storages
                    else _on_cpu(t, storages))
                op.func(*args, **kwargs)


def _tied_groups(model: torch.nn.Module) -> list[list[str]]:
    """Names that share one parameter object (tied weights), groups of two or more."""
    groups: dict[int, list[str]] = {}
    for name, p in model.named_parameters(remove_duplicate=False):
        groups.setdefault(id(p), []).append(name)
    return [g for g in groups.values() if len(g) > 1]


def _retie(model: torch.nn.Module, tied: list[list[str]]) -> None:
    """`to_empty` gives each module its own new parameter; point tied names at one again."""
    for names in tied:
        first = model.get_parameter(names[0])
        for name in names[1:]:
            owner, _, attr = name.rpartition(".")
            setattr(model.get_submodule(owner), attr, first)


def _assign(model: torch.nn.Module, name: str, value: torch.Tensor, device: torch.device) -> None:
    """Copy a whole tensor's value into `model`'s tensor `name` (for a DTensor: this rank's slice)."""
    owner, _, attr = name.rpartition(".")
    target = getattr(model.get_submodule(owner), attr)
    value = value.to(device=device, dtype=target.dtype)
    if hasattr(target, "device_mesh"):  # a DTensor shard: take this rank's slice, no communication
        from torch.distributed.tensor import distribute_tensor

        local = distribute_tensor(value, target.device_mesh, target.placements, src_data_rank=None).to_local()
        target.to_local().copy_(local)
    else:
        target.copy_(value)
