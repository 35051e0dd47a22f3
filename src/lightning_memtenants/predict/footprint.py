"""What nvidia-smi will show for a CUDA prediction: the allocator's reserved peak, the CUDA context, NCCL's buffers.

``torch.cuda.max_memory_reserved`` is what the caching allocator took from the driver; nvidia-smi (NVML's
``used``) also counts what the driver and NCCL take outside it. The three are estimated apart and summed by
:func:`device_footprint`; every assumption is in its ``notes``.

**The CUDA context** (:func:`cuda_context_bytes`) is a per-thread-slot reservation plus the kernels loaded.

- The driver reserves memory for every thread an SM can keep resident (its stack, 1 KiB per thread by default,
  ``cudaLimitStackSize``, and its bookkeeping), so a bare context grows with ``SMs x threads per SM``. The line is
  drawn through two published bare contexts (``cudaMemGetInfo`` before and after creating the primary context,
  no kernel loaded; llama.cpp PR #23604, 2026): an RTX PRO 6000 Blackwell (188 SMs x 1536
  threads) takes 555 MiB, an RTX 4060 Ti (34 x 1536) 107 MiB. That is 1,986 bytes per thread slot and 8 MiB
  fixed; an A100 (108 x 2048) comes to 427 MiB, an H100 SXM (132 x 2048) to 520 MiB.
- With lazy module loading (``CUDA_MODULE_LOADING=LAZY``: CUDA 11.7 and later, which PyTorch sets since 1.13,
  pytorch/pytorch#86509; CUDA's own default since 12.2), a kernel is loaded on its first launch: the few hundred
  a training step runs are not counted.
- Eager loading (``CUDA_MODULE_LOADING=EAGER``, or a CUDA before 11.7) loads every kernel of torch's libraries for
  the GPU's architecture at the first CUDA call. Its size is the published context minus the bare one, by the CUDA
  version of the build that was measured: CUDA 10.x from a GTX 1080 with torch 1.8.2+cu101 (721 MiB,
  pytorch/pytorch#55277), 11.0-11.1 from an RTX 3090 with torch 1.8.2+cu111 (1687 MiB, same thread), 11.2-11.6
  from HF's V100 with CUDA 11.2 (1343 MB, "Model training anatomy"), each less the 2 MiB segment of the tensor
  that created the context; 11.7 and later from #86509 (torch 1.13+cu117: 666,632,192 bytes eager against
  287,047,680 lazy, so 379,584,512 bytes of kernels).

**NCCL's buffers** (:func:`nccl_buffer_bytes`) follow NCCL's defaults (``src/init.cc``, ``src/transport/p2p.cc``,
``src/transport/nvls.cc``, ``src/graph/search.cc`` of NCCL 2.30, June 2026) for ``world_size`` ranks on one node:

- Each ring channel has one send and one receive connection per rank. A protocol's buffer is ``NCCL_LL_BUFFSIZE``
  (8 lines x 512 threads x 8 steps x 16 bytes = 524,288), ``NCCL_LL128_BUFFSIZE`` (120 x 640 threads x 8 steps
  x 8 = 4,915,200) and ``NCCL_BUFFSIZE`` (4 MiB, the SIMPLE protocol). The receiver holds LL, LL128 and SIMPLE;
  on A100s (P2P read, compute capability 8.0 only) the sender holds SIMPLE instead. Each side adds a 4 KiB
  header and is rounded up to 2 MiB (``CUDA_IPC_MIN``): with the defaults, send 2 MiB + receive 10 MiB (or 6 + 6
  with P2P read), 12 MiB per channel.
- The channels: NCCL's ring search over NVSwitch fits ``NVLink bandwidth / speed`` rings at the first speed of its
  list (A100: 12 links x 20 GB/s at 40, 6 rings; H100 and H200: 18 x 20.6 at 60, 6; B200: 18 x 40.1 at 90, 8),
  doubles them where the speed is 25 GB/s or more, and doubles them again when it connects: 24 channels on A100,
  H100 and H200, 32 on B200. Other GPUs are taken as PCIe peers with P2P, with the 2 channels NCCL's log shows for
  four RTX 4090s (tinygrad/open-gpu-kernel-modules#22). ``NCCL_MIN_NCHANNELS`` and ``NCCL_MAX_NCHANNELS`` clamp
  the result.
- NVLink SHARP (NVLS) on NVSwitch systems of compute capability 9.0 or later (H100, H200, GH200, B200), unless
  ``NCCL_NVLS_ENABLE=0``: ``NCCL_NVLS_NCHANNELS`` (16 on Hopper, 24 on Blackwell) x 2 x ``NCCL_NVLS_CHUNKSIZE``
  (128 KiB) x 8 steps x one head per rank, rounded to 2 MiB, plus 2 MiB of credits: 258 MiB on 8 H100s.
- DDP (all-reduce) and FSDP (all-gather and reduce-scatter) use the default process group's one communicator,
  so they hold the same buffers; one process holds none.

Not modelled: the tree connections NCCL makes for a small all-reduce (up to as much again as the ring), NCCL's
small per-channel device tables (each rounded to a 2 MiB page under cuMem), the communicators of tensor or
hybrid parallelism, cuDNN's workspaces and other processes on the GPU.
"""

from __future__ import annotations

import os
import re
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from lightning_memtenants.checks import brief
from lightning_memtenants.checks import world_size as check_world_size
from lightning_memtenants.core.record import StepReport
from lightning_memtenants.predict.cuda_model import GPUS, CudaTarget

MIB = 1 << 20
STRATEGIES = (None, "ddp", "fsdp")

# Streaming multiprocessors of each GPU in ``cuda_model.GPUS``, the full part (H100: the SXM5's 132, not the
# PCIe card's 114), from NVIDIA's data sheets.
SMS: dict[str, int] = {
    "V100": 80,
    "T4": 40,
    "RTX2080TI": 68,
    "A100": 108,
    "A30": 56,
    "A10": 72,
    "A10G": 80,
    "A40": 84,
    "A6000": 84,
    "RTX3090": 82,
    "L4": 58,
    "L40S": 142,
    "RTX4090": 128,
    "RTX6000ADA": 142,
    "H100": 132,
    "H200": 132,
    "GH200": 132,
    "B200": 148,
    "RTX5090": 170,
}
# A part for each compute capability that no name in ``GPUS`` has, for a target given as ``sm_XY``.
CAPABILITY_PARTS: dict[tuple[int, int], tuple[str, int]] = {
    (5, 0): ("GTX 750 Ti", 5),
    (5, 2): ("GTX TITAN X", 24),
    (5, 3): ("Jetson Nano", 1),
    (6, 0): ("P100", 56),
    (6, 1): ("GTX 1080", 20),
    (6, 2): ("Jetson TX2", 2),
    (7, 2): ("Jetson AGX Xavier", 8),
    (8, 7): ("Jetson AGX Orin", 16),
    (10, 1): ("Jetson AGX Thor", 20),
    (10, 3): ("B300", 148),
    (11, 0): ("Jetson AGX Thor", 20),
    (12, 1): ("GB10", 48),
}
# Maximum resident threads per SM (CUDA C++ Programming Guide, "Compute Capabilities"); 2048 where not listed.
THREADS_PER_SM: dict[tuple[int, int], int] = {(7, 5): 1024, (8, 6): 1536, (8, 9): 1536, (12, 0): 1536, (12, 1): 1536}
DEFAULT_THREADS_PER_SM = 2048


@dataclass(frozen=True)
class ContextMeasurement:
    """A published CUDA context, the figure a model of it is drawn from.

    Args:
        gpu: the GPU it was measured on.
        sms: its streaming multiprocessors.
        threads_per_sm: the threads an SM keeps resident.
        cuda: the CUDA version of the build.
        measured_bytes: the memory the process used on the device, as published.
        tensor_bytes: of that, the allocator's segment of the tensor that created the context.
        source: where it was published.
    """

    gpu: str
    sms: int
    threads_per_sm: int
    cuda: str
    measured_bytes: int
    tensor_bytes: int
    source: str

    @property
    def thread_slots(self) -> int:
        """``sms x threads_per_sm``, what the driver reserves for."""
        return self.sms * self.threads_per_sm

    @property
    def context_bytes(self) -> int:
        """The context alone: the measured figure less the tensor's segment."""
        return self.measured_bytes - self.tensor_bytes


LLAMA_CPP = "llama.cpp PR #23604 (cudaMemGetInfo around primary-context creation, no kernel loaded)"
BARE_CONTEXTS = (
    ContextMeasurement("RTX 4060 Ti", 34, 1536, "unknown", 107 * MIB, 0, LLAMA_CPP),
    ContextMeasurement("RTX PRO 6000 Blackwell", 188, 1536, "unknown", 555 * MIB, 0, LLAMA_CPP),
)
EAGER_CONTEXTS = (
    ContextMeasurement("GTX 1080", 20, 2048, "10.1", 721 * MIB, 2 * MIB, "pytorch/pytorch#55277, torch 1.8.2+cu101"),
    ContextMeasurement("RTX 3090", 82, 1536, "11.1", 1687 * MIB, 2 * MIB, "pytorch/pytorch#55277, torch 1.8.2+cu111"),
    ContextMeasurement("V100", 80, 2048, "11.2", 1343 * MIB, 2 * MIB, "HF, Model training anatomy (CUDA 11.2)"),
)
# torch 1.13+cu117 with CUDA_MODULE_LOADING=DEFAULT (eager in 11.7) against LAZY, same GPU and tensor (#86509).
EAGER_KERNELS_11_7_BYTES = 666_632_192 - 287_047_680
LAZY_SINCE = (11, 7)

# NCCL's defaults (src/include/device.h, src/init.cc, src/include/comm.h, src/transport/nvls.cc).
NCCL_STEPS = 8
NCCL_LL_BUFFSIZE = 8 * 512 * NCCL_STEPS * 16  # NCCL_LL_LINES_PER_THREAD x NCCL_LL_MAX_NTHREADS x steps x line
NCCL_LL128_BUFFSIZE = 120 * 640 * NCCL_STEPS * 8  # NCCL_LL128_ELEMS_PER_THREAD x NCCL_LL128_MAX_NTHREADS x steps x 8
NCCL_BUFFSIZE = 1 << 22
NCCL_CONNECTION_HEADER_BYTES = 4096  # ncclSendMem and ncclRecvMem, each padded to MEM_ALIGN
NCCL_IPC_ALIGN = 2 * MIB  # CUDA_IPC_MIN, also the cuMem granularity NVLS rounds to
NCCL_MAX_CHANNELS = 64  # MAXCHANNELS; the ring search stops at half of it
NCCL_NVLS_CHUNKSIZE = 128 * 1024
NCCL_NVLS_CREDIT_BYTES = 64
NVLS_CHANNELS = {9: 16, 10: 24}  # NVLS_NCHANNELS_SM90, NVLS_NCHANNELS_SM100_NVL (one node)
# Per capability of an NVSwitch node: NVLinks per GPU, NCCL's GB/s per link (src/graph/topo.h), first search speed.
NVSWITCH = {(8, 0): (12, 20.0, 40.0), (9, 0): (18, 20.6, 60.0), (10, 0): (18, 40.1, 90.0)}
NVSWITCH_GPUS = frozenset({"A100", "H100", "H200", "GH200", "B200", "sm_80", "sm_90", "sm_100"})
PCIE_CHANNELS = 2  # NCCL's log for four PCIe RTX 4090s (tinygrad/open-gpu-kernel-modules#22): channels 00 and 01


@dataclass(frozen=True)
class DeviceFootprint:
    """What one rank's process holds on its GPU, as nvidia-smi reads it, in three parts that add up.

    Args:
        reserved_peak_bytes: the allocator's reserved high-water mark (the report's ``peak_reserved_bytes``).
        context_bytes: the CUDA context and the kernels loaded, for that GPU and CUDA version.
        nccl_bytes: NCCL's buffers for the strategy and world size (0 for one process without a strategy).
        notes: what each part assumes.
    """

    reserved_peak_bytes: int
    context_bytes: int
    nccl_bytes: int
    notes: list[str] = field(default_factory=list)

    @property
    def total_bytes(self) -> int:
        """The three parts together: what nvidia-smi reads for the process."""
        return self.reserved_peak_bytes + self.context_bytes + self.nccl_bytes


def device_footprint(
    report: StepReport,
    target: CudaTarget,
    *,
    world_size: int = 1,
    strategy: str | None = None,
    cuda_version: str | None = None,
    lazy_loading: bool | None = None,
    environ: Mapping[str, str] | None = None,
) -> DeviceFootprint:
    """nvidia-smi's figure for one rank of a CUDA prediction: its reserved peak, the CUDA context, NCCL's buffers.

    The allocator's figure is what ``max_memory_reserved`` reads; the other two are outside it, and an OOM
    comes when the three together reach the GPU's memory.

    Args:
        report: a step of a CUDA prediction, with reserved bytes (``peak_reserved_bytes``, else the phases' highest
            ``reserved_bytes``).
        target: the GPU (:func:`~lightning_memtenants.predict.cuda_model.resolve_target`).
        world_size: the ranks of ``strategy`` (1 without one).
        strategy: ``None``, ``"ddp"`` or ``"fsdp"``.
        cuda_version: the CUDA version of the torch build (``"12.8"``); ``None`` for 11.7 or later.
        lazy_loading: whether kernels load on first use; ``None`` reads ``CUDA_MODULE_LOADING`` (``EAGER`` is
            eager, anything else lazy, as torch sets it).
        environ: the environment to read ``CUDA_MODULE_LOADING`` and NCCL's variables from; ``None`` for
            ``os.environ``.

    Returns:
        The three parts, their sum as ``total_bytes``, and the notes on what each assumes.

    Raises:
        ValueError: naming the argument, if ``report`` has no reserved bytes, ``target`` is not a
            :class:`CudaTarget`, or any other argument is not one the functions below accept.
    """
    if not isinstance(report, StepReport):
        raise ValueError(f"report must be a StepReport of a CUDA prediction, got {brief(report)}")
    reserved = _reserved_peak(report)
    if reserved is None:
        raise ValueError("report must be a CUDA prediction's step, with reserved bytes; this one measured none")
    context, context_notes = _context(target, cuda_version, lazy_loading, environ)
    nccl, nccl_notes = _nccl(world_size, strategy, target, environ)
    notes = [f"reserved peak: the allocator's modelled max_memory_reserved, {reserved / MIB:,.1f} MiB"]
    return DeviceFootprint(reserved, context, nccl, notes + context_notes + nccl_notes)


def cuda_context_bytes(target: CudaTarget, cuda_version: str | None = None, *, lazy_loading: bool | None = None) -> int:
    """The CUDA context of one process on ``target``: the driver's per-thread reservation and the kernels loaded.

    See the module's docstring for the model and its sources.

    Args:
        target: the GPU.
        cuda_version: the CUDA version of the torch build (``"11.2"``, ``"12.8"``); ``None`` for 11.7 or later.
        lazy_loading: whether kernels load on first use; ``None`` reads ``CUDA_MODULE_LOADING`` from
            ``os.environ`` (``EAGER`` is eager). A CUDA before 11.7 loads eagerly whatever is asked.

    Returns:
        Bytes on the device outside the allocator, before NCCL.

    Raises:
        ValueError: if ``target`` is not a :class:`CudaTarget`, ``cuda_version`` is not a version like ``"12.8"``,
            or ``lazy_loading`` is not a bool or None.
    """
    return _context(target, cuda_version, lazy_loading, None)[0]


def nccl_buffer_bytes(
    world_size: int, strategy: str | None, target: CudaTarget, *, environ: Mapping[str, str] | None = None
) -> int:
    """NCCL's device buffers on one rank for ``strategy`` over ``world_size`` GPUs of one node, from its defaults.

    ``ring channels x (send + receive connection) + NVLS``; see the module's docstring for each term.

    Args:
        world_size: the ranks (1: no communicator has peers, so no buffers).
        strategy: ``None`` (one process), ``"ddp"`` or ``"fsdp"``.
        target: the GPU, which sets the channels, P2P read and NVLS.
        environ: the environment to read ``NCCL_BUFFSIZE``, ``NCCL_LL_BUFFSIZE``, ``NCCL_LL128_BUFFSIZE``,
            ``NCCL_MIN_NCHANNELS``, ``NCCL_MAX_NCHANNELS``, ``NCCL_P2P_READ_ENABLE``, ``NCCL_NVLS_ENABLE``,
            ``NCCL_NVLS_NCHANNELS`` and ``NCCL_NVLS_CHUNKSIZE`` from; ``None`` for ``os.environ``.

    Returns:
        Bytes NCCL takes from the driver on each rank.

    Raises:
        ValueError: if ``world_size`` is not a positive int, ``strategy`` is not one of ``None``, ``"ddp"`` and
            ``"fsdp"`` (or is ``None`` for more than one rank), ``target`` is not a :class:`CudaTarget`, or one
            of NCCL's variables is not a whole number.
    """
    return _nccl(world_size, strategy, target, environ)[0]


def _reserved_peak(report: StepReport) -> int | None:
    peak = getattr(report, "peak_reserved_bytes", None)
    if peak is not None:
        return int(peak)
    phases = [p for mb in report.micro_batches for p in mb.values()] or list(report.phases.values())
    values = [p.reserved_bytes for p in phases if p.reserved_bytes is not None]
    return max(values) if values else None


def _check_target(target: Any) -> CudaTarget:
    if not isinstance(target, CudaTarget):
        raise ValueError(f"target must be a CudaTarget (resolve_target('H100')), got {brief(target)}")
    return target


def _version(cuda_version: Any) -> tuple[int, int] | None:
    if cuda_version is None:
        return None
    match = (
        re.fullmatch(r"\s*(\d{1,2})(?:\.(\d{1,2}))?(?:\.\d+)?\s*", cuda_version)
        if isinstance(cuda_version, str)
        else None
    )
    if match is None:
        raise ValueError(f"cuda_version must be None or a CUDA version like '12.8', got {brief(cuda_version)}")
    return int(match.group(1)), int(match.group(2) or 0)


def _part(target: CudaTarget) -> tuple[str, int, int]:
    """The part assumed for ``target``: its name, SMs and threads per SM."""
    threads = THREADS_PER_SM.get(target.capability, DEFAULT_THREADS_PER_SM)
    if target.name in SMS:
        return target.name, SMS[target.name], threads
    named = [name for name, capability in GPUS.items() if capability == target.capability]
    if named:
        return named[0], SMS[named[0]], threads
    name, sms = CAPABILITY_PARTS[target.capability]
    return name, sms, threads


def bare_context_bytes(thread_slots: int) -> int:
    """A context with no kernel loaded, on a GPU that keeps ``thread_slots`` threads resident (SMs x threads per SM).

    The line through :data:`BARE_CONTEXTS` (floor of the exact rational value).

    Args:
        thread_slots: SMs times the threads each keeps resident.

    Returns:
        Bytes of the bare context.
    """
    low, high = BARE_CONTEXTS
    span = high.thread_slots - low.thread_slots
    return low.context_bytes + (thread_slots - low.thread_slots) * (high.context_bytes - low.context_bytes) // span


def eager_kernel_bytes(version: tuple[int, int] | None) -> tuple[int, str]:
    """The kernels an eager context loads for a build of CUDA ``version``, and the measurement they come from.

    Args:
        version: ``(major, minor)``; ``None`` for 11.7 or later.

    Returns:
        The bytes, and a phrase naming the source.
    """
    if version is None or version >= LAZY_SINCE:
        return EAGER_KERNELS_11_7_BYTES, "pytorch/pytorch#86509 (torch 1.13+cu117, eager minus lazy)"
    cuda = "10.1" if version < (11, 0) else "11.1" if version <= (11, 1) else "11.2"
    measured = next(m for m in EAGER_CONTEXTS if m.cuda == cuda)
    kernels = measured.context_bytes - bare_context_bytes(measured.thread_slots)
    source = f"{measured.source}: {measured.gpu}'s {measured.context_bytes / MIB:,.0f} MiB less its bare context"
    if version < (10, 0):
        source += f" (no published context for CUDA {version[0]}.{version[1]}: CUDA 10.1's assumed)"
    return kernels, source


def _context(
    target: Any, cuda_version: Any, lazy_loading: Any, environ: Mapping[str, str] | None
) -> tuple[int, list[str]]:
    target = _check_target(target)
    version = _version(cuda_version)
    if lazy_loading is not None and not isinstance(lazy_loading, bool):
        raise ValueError(
            f"lazy_loading must be True, False or None (read CUDA_MODULE_LOADING), got {brief(lazy_loading)}"
        )
    notes = []
    if lazy_loading is None:
        mode = (os.environ if environ is None else environ).get("CUDA_MODULE_LOADING", "LAZY").strip().upper()
        lazy_loading = mode != "EAGER"
    if lazy_loading and version is not None and version < LAZY_SINCE:
        notes.append(f"CUDA {cuda_version} predates lazy module loading (11.7): its context loads every kernel")
        lazy_loading = False
    name, sms, threads = _part(target)
    bare = bare_context_bytes(sms * threads)
    where = f"{name}, {sms} SMs x {threads} threads"
    if target.name not in SMS and target.name != name:
        where += f", the SMs of a {name} assumed for {target.name}"
    notes.append(
        f"CUDA context: {bare / MIB:,.0f} MiB for the driver's reservation ({where}; the line through two published"
        " bare contexts, llama.cpp PR #23604)"
    )
    if lazy_loading:
        notes.append("lazy module loading: the kernels a step loads on first use are not counted")
        return bare, notes
    kernels, source = eager_kernel_bytes(version)
    notes.append(f"eager module loading: {kernels / MIB:,.0f} MiB of kernels, from {source}")
    return bare + kernels, notes


def _env_int(environ: Mapping[str, str], name: str, default: int) -> int:
    value = environ.get(name)
    if value is None or value.strip() == "":
        return default
    try:
        number = int(value.strip())
    except ValueError:
        raise ValueError(f"{name} must be a whole number, got {brief(value)}") from None
    if number < 0:
        raise ValueError(f"{name} must be a whole number of at least 0, got {brief(value)}")
    return number


def _align(nbytes: int, alignment: int = NCCL_IPC_ALIGN) -> int:
    return -(-nbytes // alignment) * alignment


def ring_channels(target: CudaTarget, environ: Mapping[str, str] | None = None) -> int:
    """The collective channels NCCL builds on one node of ``target`` GPUs, as its ring search would.

    Args:
        target: the GPU; A100, H100, H200, GH200 and B200 (and ``sm_80``, ``sm_90``, ``sm_100``) are taken as
            NVSwitch nodes, any other GPU as PCIe peers.
        environ: the environment to read ``NCCL_MIN_NCHANNELS`` and ``NCCL_MAX_NCHANNELS`` from.

    Returns:
        The channels.
    """
    environ = os.environ if environ is None else environ
    if target.name in NVSWITCH_GPUS and target.capability in NVSWITCH:
        links, link_gbs, speed = NVSWITCH[target.capability]
        found = min(int(links * link_gbs // speed), NCCL_MAX_CHANNELS // 2)
        if speed >= 25.0 and not (target.capability > (8, 0) and speed < 50.0 and found > 4):  # ncclTopoDupChannels
            found = min(2 * found, NCCL_MAX_CHANNELS // 2)
        channels = min(2 * found, NCCL_MAX_CHANNELS)  # connect.cc doubles them again
    else:
        channels = PCIE_CHANNELS
    channels = min(channels, _env_int(environ, "NCCL_MAX_NCHANNELS", NCCL_MAX_CHANNELS) or NCCL_MAX_CHANNELS)
    return max(channels, min(_env_int(environ, "NCCL_MIN_NCHANNELS", 0), NCCL_MAX_CHANNELS))


def _nccl(world_size: Any, strategy: Any, target: Any, environ: Mapping[str, str] | None) -> tuple[int, list[str]]:
    check_world_size(world_size)
    if strategy not in STRATEGIES or not (strategy is None or isinstance(strategy, str)):
        raise ValueError(f"strategy must be one of {list(STRATEGIES)}, got {brief(strategy)}")
    if strategy is None and world_size > 1:
        raise ValueError(f"strategy must be 'ddp' or 'fsdp' for world_size {world_size}, got None")
    target = _check_target(target)
    environ = os.environ if environ is None else environ
    buffs = {
        "LL": _env_int(environ, "NCCL_LL_BUFFSIZE", NCCL_LL_BUFFSIZE),
        "LL128": _env_int(environ, "NCCL_LL128_BUFFSIZE", NCCL_LL128_BUFFSIZE),
        "SIMPLE": _env_int(environ, "NCCL_BUFFSIZE", NCCL_BUFFSIZE),
    }
    if world_size == 1:
        return 0, (["NCCL: one rank, no peers, no buffers"] if strategy else [])
    read = bool(_env_int(environ, "NCCL_P2P_READ_ENABLE", int(target.capability == (8, 0))))
    header = NCCL_CONNECTION_HEADER_BYTES
    send = _align(header + (buffs["SIMPLE"] if read else 0))
    receive = _align(header + buffs["LL"] + buffs["LL128"] + (0 if read else buffs["SIMPLE"]))
    channels = ring_channels(target, environ)
    ring = channels * (send + receive)
    kind = "NVSwitch" if target.name in NVSWITCH_GPUS and target.capability in NVSWITCH else "PCIe, P2P"
    notes = [
        f"NCCL ({strategy}, {world_size} ranks on one {kind} node): an estimate from NCCL's defaults,"
        f" {channels} ring channels x (send {send / MIB:,.0f} + receive {receive / MIB:,.0f} MiB)"
        f" = {ring / MIB:,.0f} MiB (buffers LL {buffs['LL']:,}, LL128 {buffs['LL128']:,}, SIMPLE {buffs['SIMPLE']:,}"
        f" bytes{', P2P read' if read else ''})"
    ]
    nvls = 0
    major = target.capability[0]
    if target.name in NVSWITCH_GPUS and major in NVLS_CHANNELS and _env_int(environ, "NCCL_NVLS_ENABLE", 2) != 0:
        nvls_channels = _env_int(environ, "NCCL_NVLS_NCHANNELS", NVLS_CHANNELS[major]) or NVLS_CHANNELS[major]
        chunk = _env_int(environ, "NCCL_NVLS_CHUNKSIZE", NCCL_NVLS_CHUNKSIZE)
        buffers = _align(nvls_channels * 2 * chunk * NCCL_STEPS * world_size)
        credits = _align(nvls_channels * 2 * NCCL_NVLS_CREDIT_BYTES * world_size)
        nvls = buffers + credits
        notes.append(
            f"NCCL NVLS (NVLink SHARP, multicast assumed on; NCCL_NVLS_ENABLE=0 to leave out): {nvls_channels} channels"
            f" x 2 x {chunk * NCCL_STEPS:,} bytes x {world_size} heads + credits = {nvls / MIB:,.0f} MiB"
        )
    notes.append(
        "NCCL: not modelled: tree connections (small all-reduces), NCCL's per-channel device tables, other"
        " communicators (tensor or hybrid parallelism)"
    )
    return ring + nvls, notes
