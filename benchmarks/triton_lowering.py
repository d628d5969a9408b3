"""Inductor's Triton kernels for one CUDA GPU, generated on a machine without one: what a compiled
graph's kernels would read and write on an H200, counted on the CPU (issue #39).

On the CPU, inductor fuses with its C++ backend and its CPU thresholds (a pointwise kernel may read 12
buffers and hold 50 ops before it is stored, against 8 and 30 for GPUs; loops of different lengths
fuse, which Triton's cannot). Byte counts taken there can miss what Triton stores between kernels.
This module lowers the same graphs again for CUDA, without a GPU:

1. `capture()`: while it is open, every graph inductor compiles (each compiled forward and backward,
   after AOTAutograd's partition) is recorded, and the run goes on without executing anything: each
   graph's outputs are zeros of the shapes fake tensors give. So a model's training step runs on the CPU
   in seconds, its backward included, and flex_attention may take a backward on the CPU here, since
   nothing of it runs.
2. `lower_for_cuda(graph)`: the recorded graph's devices are set to cuda:0, its inputs become fake
   CUDA tensors, and inductor lowers and schedules it for CUDA with an H200's properties (Triton's
   fusion rules and thresholds, flex_attention's Triton templates). It generates the Triton source and
   counts each kernel's bytes (`GraphLowering.count_bytes`); it compiles and runs nothing.

Nothing is timed, and autotuning, which picks launch configurations, not fusions, is not run. The
count is inductor's own (`GraphLowering.count_bytes`, each kernel's buffers as inductor sizes them).
`benchmarks/mmv2_gpu.sh` prints it beside the same count taken on a GPU, which checks it.
`reached_bytes` gives it again with each access at the elements its index reaches: inductor takes
worst-case accesses, which count a broadcast slice of a wide buffer as the whole buffer.

It reaches into torch's private modules (inductor's compile path, the CUDA device interface, fake
tensors), as torch 2.11 and 2.13 have them, and patches them only while its context managers are open.
Should a release move them, `TritonLoweringUnavailable` says what is missing.
"""

from __future__ import annotations

import contextlib
import copy
import dataclasses
import importlib
import math
import os
import types
from collections.abc import Iterator
from typing import Any

import torch

H200 = types.SimpleNamespace(  # torch.cuda.get_device_properties on the lent machines (sm_90, 132 SMs)
    name="NVIDIA H200", major=9, minor=0, multi_processor_count=132, regs_per_multiprocessor=65536,
    max_threads_per_multi_processor=2048, max_threads_per_block=1024, warp_size=32,
    total_memory=143771 * 2**20, L2_cache_size=60 * 2**20, shared_memory_per_block_optin=232448,
    shared_memory_per_multiprocessor=233472, gcnArchName="")


class TritonLoweringUnavailable(RuntimeError):
    """This torch or triton lacks what the lowering patches (a private API moved)."""


@dataclasses.dataclass
class Captured:
    """One graph inductor was given: the partitioned forward or backward, and its example inputs."""
    graph: torch.fx.GraphModule
    inputs: list[Any]
    backward: bool
    inference: bool


Buffer = tuple[torch.dtype, tuple[int, ...]]  # a buffer's dtype and shape


@dataclasses.dataclass
class Lowered:
    """A graph lowered for CUDA: inductor's byte count, the same count with each access at the elements
    its index reaches (`reached_bytes`), one row per kernel, the buffers each kernel reads and writes
    (library calls' included; graph inputs inductor does not name are left out), and the generated
    source."""
    bytes: int
    reached: int
    kernels: list[str]
    buffers: list[tuple[list[Buffer], list[Buffer]]]
    source: str

    @property
    def written(self) -> list[Buffer]:
        """Every buffer a kernel writes, in the kernels' order."""
        return [buffer for _, writes in self.buffers for buffer in writes]


_MISSING = object()


@contextlib.contextmanager
def _patched(*changes: tuple[Any, str, Any]) -> Iterator[None]:
    """setattr(owner, name, value) for each change while open; each attribute restored after (a class
    attribute it inherited, removed again)."""
    saved = []
    try:
        for owner, name, value in changes:
            saved.append((owner, name, owner.__dict__.get(name, _MISSING) if isinstance(owner, type) else getattr(owner, name)))
            setattr(owner, name, value)
        yield
    finally:
        for owner, name, value in reversed(saved):
            if value is _MISSING:
                delattr(owner, name)
            else:
                setattr(owner, name, value)


def _modules() -> types.SimpleNamespace:
    try:
        importlib.import_module("triton")  # Triton's code generation needs the package, not a GPU
        from triton.backends.compiler import GPUTarget

        from torch._dynamo import device_interface
        from torch._inductor import compile_fx, scheduler
        from torch._inductor.async_compile import AsyncCompile
        from torch._inductor.graph import GraphLowering
        from torch._subclasses.fake_tensor import FakeTensor, FakeTensorMode
        flex = importlib.import_module("torch.nn.attention.flex_attention")
        for owner, name in ((compile_fx, "_compile_fx_inner"), (scheduler, "has_triton"), (flex, "_validate_device"),
                            (device_interface, "CudaInterface"), (GraphLowering, "count_bytes"),
                            (AsyncCompile, "use_process_pool")):
            getattr(owner, name)
    except (ImportError, AttributeError) as err:
        raise TritonLoweringUnavailable(f"lowering for CUDA without a GPU needs triton and inductor's internals as "
                                        f"torch 2.11-2.13 have them: {err}") from err
    return types.SimpleNamespace(compile_fx=compile_fx, scheduler=scheduler, GraphLowering=GraphLowering,
                                 FakeTensor=FakeTensor, FakeTensorMode=FakeTensorMode, flex=flex,
                                 cuda=device_interface.CudaInterface, GPUTarget=GPUTarget, AsyncCompile=AsyncCompile)


def _shapes_only(graph: torch.fx.GraphModule, fake_mode_type: type) -> Any:
    """A stand-in for the compiled graph: zeros of the shapes, strides and dtypes its outputs would have."""
    def run(args: list[Any]) -> list[Any]:
        mode = fake_mode_type(allow_non_fake_inputs=True)
        with mode, torch.autocast("cpu", enabled=False):
            outputs = torch.fx.Interpreter(graph).run(*[mode.from_tensor(a) if isinstance(a, torch.Tensor) else a
                                                        for a in args])
        args.clear()
        return [torch.empty_strided(o.shape, o.stride(), dtype=o.dtype).zero_() if isinstance(o, torch.Tensor) else o
                for o in outputs]
    run._boxed_call = True  # inductor's calling convention: the inputs as one list, which it may clear
    return run


@contextlib.contextmanager
def capture() -> Iterator[list[Captured]]:
    """Record each graph inductor is given to compile, on the CPU, and run none of them (module doc)."""
    m = _modules()
    graphs: list[Captured] = []

    def record(gm: torch.fx.GraphModule, example_inputs: Any, **kwargs: Any) -> Any:
        graph = torch.fx.GraphModule(gm, copy.deepcopy(gm.graph))  # lower_for_cuda changes a copy of it
        graphs.append(Captured(graph, list(example_inputs), bool(kwargs.get("is_backward")), bool(kwargs.get("is_inference"))))
        return _shapes_only(graph, m.FakeTensorMode)

    torch._dynamo.reset()  # graphs compiled before would be reused, and not given to inductor
    try:
        with _patched((m.compile_fx, "_compile_fx_inner", record), (m.flex, "_validate_device", lambda *a, **k: None)):
            yield graphs
    finally:
        torch._dynamo.reset()  # no stand-in stays cached to answer a later call with zeros


def _to_cuda(graph: torch.fx.GraphModule) -> None:
    """Every device argument in the graph and its subgraphs (flex_attention's score and mask graphs) -> cuda:0."""
    cuda = torch.device("cuda", 0)
    for module in graph.modules():
        if not isinstance(module, torch.fx.GraphModule):
            continue
        for node in module.graph.nodes:
            node.args = tuple(cuda if isinstance(a, torch.device) else a for a in node.args)
            node.kwargs = {k: cuda if isinstance(v, torch.device) else v for k, v in node.kwargs.items()}
        module.recompile()


@contextlib.contextmanager
def _an_h200(m: types.SimpleNamespace, done: list[Any]) -> Iterator[None]:
    """torch and triton answer as for one H200, and inductor stops after generating the code."""
    from triton.runtime import driver

    def lowered_only(self: Any) -> Any:  # GraphLowering.compile_to_module: the source and the count, no compiling
        source = self.codegen()
        done.append(Lowered(self.count_bytes()[0], reached_bytes(self), kernel_rows(self), kernel_buffers(self),
                            getattr(source[0], "value", str(source))))
        raise _Lowered

    class Target:
        def get_current_target(self) -> Any:
            return m.GPUTarget("cuda", 90, 32)

    props = staticmethod(lambda device=None: H200)
    changes = [
        (m.cuda, "get_device_properties", props), (m.cuda, "get_compute_capability", staticmethod(lambda device=None: 90)),
        (m.cuda, "is_available", staticmethod(lambda: True)), (m.cuda, "current_device", staticmethod(lambda: 0)),
        (m.cuda, "device_count", staticmethod(lambda: 1)),
        (m.cuda, "is_bf16_supported", staticmethod(lambda including_emulation=False: True)),
        (m.cuda.Worker, "get_device_properties", props), (m.cuda.Worker, "current_device", staticmethod(lambda: 0)),
        (torch.cuda, "get_device_properties", lambda device=None: H200),
        (torch.cuda, "get_device_capability", lambda device=None: (9, 0)),
        (torch.cuda, "current_device", lambda: 0), (torch.cuda, "device_count", lambda: 1),
        (torch.cuda, "get_rng_state", lambda device="cuda": torch.zeros(16, dtype=torch.uint8)),
        (torch.cuda, "set_rng_state", lambda state, device="cuda": None),
        (m.scheduler, "has_triton", lambda: True), (m.GraphLowering, "compile_to_module", lowered_only),
        # a warm pool of compile workers would get each kernel as it is generated, to compile it
        (m.AsyncCompile, "use_process_pool", classmethod(lambda cls: False)),
        # Tensor.copy_'s Python binding takes a CUDA device guard, which a CPU build of torch lacks; the
        # op itself, as fake tensors run it, needs none
        (m.FakeTensor, "copy_", lambda self, src, non_blocking=False: torch.ops.aten.copy_.default(self, src, non_blocking)),
    ]
    if hasattr(driver, "_active"):
        changes.append((driver, "_active", Target()))
    with _patched(*changes):
        yield


class _Lowered(Exception):
    """Raised once the code is generated and counted: inductor stops there."""


def lower_for_cuda(captured: Captured) -> Lowered:
    """Lower one captured graph for CUDA (an H200) on fake tensors: inductor's byte count and its
    Triton kernels, generated and not compiled."""
    m = _modules()
    from torch._inductor import config as inductor_config
    from torch.fx.passes.fake_tensor_prop import FakeTensorProp

    graph = torch.fx.GraphModule(captured.graph, copy.deepcopy(captured.graph.graph))
    _to_cuda(graph)
    mode = m.FakeTensorMode(allow_non_fake_inputs=True)

    def fake(t: Any) -> Any:
        if not isinstance(t, torch.Tensor):
            return t
        with mode:
            return torch.empty_strided(t.shape, t.stride(), dtype=t.dtype, device="cuda")

    inputs = [fake(t) for t in captured.inputs]
    for module in graph.modules():  # subgraph placeholders keep the CPU's fake values: renew them
        if isinstance(module, torch.fx.GraphModule) and module is not graph:
            for node in module.graph.nodes:
                value = node.meta.get("val")
                if isinstance(value, torch.Tensor) and value.device.type == "cpu":
                    node.meta["val"] = fake(value)
    done: list[Lowered] = []
    # no cache: nothing to hit, and no fresh cache folder that inductor would keep when it stops
    with _an_h200(m, done), inductor_config.patch(force_disable_caches=False, fx_graph_cache=False, fx_graph_remote_cache=False):
        FakeTensorProp(graph, mode).propagate_dont_convert_inputs(*inputs)
        try:
            with mode:
                m.compile_fx.compile_fx_inner(graph, inputs, is_backward=captured.backward, is_inference=captured.inference)
        except Exception:  # noqa: BLE001 - inductor wraps what it raises; the count is taken before
            if not done:
                raise
    return done[0]


def reached_bytes(lowering: Any) -> int:
    """`GraphLowering.count_bytes` with each access of a buffer counted at the elements its index
    reaches, at most inductor's figure. Inductor counts worst-case accesses: each access at the kernel's
    whole iteration space, and in a fused kernel at the whole buffer. So a narrow slice of a wide buffer
    read by a kernel that broadcasts it (a head's gate, read once for each of its 128 dimensions, from
    the columns of a stacked projection) is counted as the whole buffer, where a GPU reads the slice
    once and serves the rest from its caches; and a decoding step's write of one position into a
    cache of 32k (an indirect index, or a mutation inductor tracks as a dependency on the whole
    buffer) counts the whole cache, read and written. Here (`_dep_elements`):
    - an access by a plain index: the elements its index variables span (`MemoryDep.get_numel`);
    - by an indirect index (the index holds a loaded value), or one inductor records as touching the
      buffer anywhere (`StarDep`, in a kernel of inductor's own loops, not a template's): one element
      per iteration of its loop;
    - an ordering-only dependency (`WeakDep`: the buffer must not be overwritten yet): nothing.
    Library calls (matmuls, attention, and attention templates' extern parts) keep inductor's figure."""
    return sum(_reached(lowering, node) for node in lowering.scheduler.nodes)


def _reached(lowering: Any, node: Any) -> int:
    """One scheduled kernel's bytes as `reached_bytes` counts them."""
    from torch._inductor.scheduler import ExternKernelSchedulerNode

    total = 0
    counted = node.get_read_write_buffer_accesses(include_reads=True, include_writes=True)
    deps = [*node.read_writes.reads, *node.read_writes.writes]
    parts = getattr(node, "get_nodes", lambda: [node])()
    for name, inductor_bytes in counted.items():
        own = [dep for dep in deps if dep.name == name]
        if isinstance(node, ExternKernelSchedulerNode) or not own:
            total += inductor_bytes
            continue
        try:
            itemsize = lowering.get_buffer(name).get_dtype().itemsize
            elements = sum(_dep_elements(lowering, dep, parts) for dep in own)
        except Exception:  # noqa: BLE001 - a buffer or loop without a static size: inductor's figure
            total += inductor_bytes
            continue
        total += min(inductor_bytes, elements * itemsize)
    return total


def _dep_elements(lowering: Any, dep: Any, parts: list[Any]) -> int:
    """The elements one access of a kernel (one of its `parts`, the nodes fused into it) reaches, as
    `reached_bytes` counts them."""
    from torch._inductor.dependencies import MemoryDep, StarDep, WeakDep

    hint = lambda n: lowering.sizevars.optimization_hint(n, fallback=0)  # noqa: E731
    if isinstance(dep, WeakDep):
        return 0
    if isinstance(dep, MemoryDep) and not dep.is_indirect():
        return hint(dep.get_numel())
    if isinstance(dep, MemoryDep):
        iterations = math.prod(hint(n) for n in dep.size)
        return min(hint(dep.get_numel()), iterations)
    if isinstance(dep, StarDep):  # bounded by its loop in a kernel of inductor's loops, not in a template
        for part in parts:  # (flex_attention's: its loop runs over the output, each step reading many keys)
            if (dep in part.read_writes.reads or dep in part.read_writes.writes) and not part.is_template():
                sizes, reduction = part.get_ranges()
                return math.prod(hint(n) for n in (*sizes, *reduction))
    raise ValueError(f"no bound for {dep}")  # inductor's figure (`_reached`)


def kernel_buffers(lowering: Any) -> list[tuple[list[Buffer], list[Buffer]]]:
    """For each scheduled kernel, the (dtype, shape) of each buffer it reads and of each it writes."""
    def named(names: Any) -> list[Buffer]:
        buffers = []
        for name in names:
            try:
                buffer = lowering.get_buffer(name)
                buffers.append((buffer.get_dtype(), tuple(int(n) for n in buffer.get_size())))
            except Exception:  # noqa: BLE001 - a buffer without a static shape or name: not listed
                continue
        return buffers

    return [(named(node.get_read_write_buffer_accesses(include_reads=True, include_writes=False)),
             named(node.get_read_write_buffer_accesses(include_reads=False, include_writes=True)))
            for node in lowering.scheduler.nodes]


def kernel_rows(lowering: Any, at_least_mib: float = 4.0) -> list[str]:
    """One row per scheduled kernel of at least `at_least_mib`: MiB moved (inductor's count; and as
    `reached_bytes` counts them, where less), kind, each buffer read and written (MiB by inductor's
    count, dtype and shape), and the graph's nodes in it (OWAI_KERNEL_NODES=1: their names)."""
    rows = []
    names = os.environ.get("OWAI_KERNEL_NODES") == "1"
    for node in lowering.scheduler.nodes:
        reads = node.get_read_write_buffer_accesses(include_reads=True, include_writes=False)
        writes = node.get_read_write_buffer_accesses(include_reads=False, include_writes=True)
        # as count_bytes adds it up: a buffer both read and written (an in-place update) counted once
        total = sum(node.get_read_write_buffer_accesses(include_reads=True, include_writes=True).values()) / 2**20
        if total < at_least_mib:
            continue

        def described(buffers: dict[str, int]) -> str:
            parts = []
            for name, size in buffers.items():
                if size < 2**20:
                    continue
                try:
                    buffer = lowering.get_buffer(name)
                    kind = f"{str(buffer.get_dtype()).removeprefix('torch.')}{list(buffer.get_size())}"
                except Exception:  # noqa: BLE001 - a buffer inductor does not name (a graph input view)
                    kind = "?"
                parts.append(f"{size / 2**20:.0f} {kind}")
            return ", ".join(parts)

        origins = {o.name if names else str(getattr(o, "target", "?")).split(".")[-1]
                   for part in getattr(node, "get_nodes", lambda: [node])() for o in (getattr(part.node, "origins", None) or [])}
        reached = _reached(lowering, node) / 2**20
        moved = f"{total:8.1f} MiB" + (f" (reached {reached:.1f})" if reached < total - 0.05 else "")
        rows.append(f"{moved}  {type(node).__name__.removesuffix('SchedulerNode') or 'Scheduler':10s}"
                    f"  reads [{described(reads)}]  writes [{described(writes)}]  {','.join(sorted(origins))[:300]}")
    return rows
