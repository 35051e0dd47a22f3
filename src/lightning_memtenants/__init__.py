"""lightning-memtenants: what is using your training memory, tenant by tenant.

The package is a pipeline: ``core`` measures, ``analysis`` explains, ``render`` prints and logs;
``predict`` runs the same pipeline under fake tensors, and ``lightning`` wires it to a Trainer.
"""

from lightning_memtenants.analysis.budget import MemoryBudgetError
from lightning_memtenants.analysis.forecast import PeakForecast
from lightning_memtenants.analysis.formulas import (
    FixedCost,
    deepspeed_estimator_bytes,
    deepspeed_zero_bytes,
    expected_fixed_cost,
    explain_fixed_cost,
    fsdp_fixed_cost_bytes,
    fsdp_gathered_bytes,
    zero_state_bytes,
)
from lightning_memtenants.analysis.leaks import LeakDetector
from lightning_memtenants.core.census import ActivationTracker, TenantCounter, take_census
from lightning_memtenants.core.record import GraphCounts, PhaseReport, StepReport
from lightning_memtenants.core.sources import (
    AcceleratorSource,
    CudaSource,
    MemorySource,
    MpsSource,
    Reading,
    TrackerSource,
    source_for,
)
from lightning_memtenants.core.tracker import LiveTensorTracker
from lightning_memtenants.evaluation import EvaluationMonitor
from lightning_memtenants.lightning.callback import MemoryTenantsCallback
from lightning_memtenants.monitor import TenantMonitor
from lightning_memtenants.names import PARTS, PHASES, TENANTS, Part, Phase, Tenant
from lightning_memtenants.predict.advise import Advice, MeasuredFix, advise
from lightning_memtenants.predict.allocator import AllocatorSettings, CachingAllocatorModel
from lightning_memtenants.predict.dryrun import Prediction, dry_run, largest_batch_size, predict, sweep
from lightning_memtenants.predict.footprint import DeviceFootprint, device_footprint
from lightning_memtenants.predict.transformer import ActivationCheck, activation_check, korthikanti_bytes
from lightning_memtenants.render.table import format_table, summary_markdown
from lightning_memtenants.units import parse_bytes

__all__ = [
    "PARTS",
    "PHASES",
    "TENANTS",
    "AcceleratorSource",
    "ActivationCheck",
    "ActivationTracker",
    "Advice",
    "AllocatorSettings",
    "CachingAllocatorModel",
    "CudaSource",
    "DeviceFootprint",
    "EvaluationMonitor",
    "FixedCost",
    "GraphCounts",
    "LeakDetector",
    "LiveTensorTracker",
    "MeasuredFix",
    "MemoryBudgetError",
    "MemorySource",
    "MemoryTenantsCallback",
    "MpsSource",
    "Part",
    "PeakForecast",
    "Phase",
    "PhaseReport",
    "Prediction",
    "Reading",
    "StepReport",
    "Tenant",
    "TenantCounter",
    "TenantMonitor",
    "TrackerSource",
    "activation_check",
    "advise",
    "deepspeed_estimator_bytes",
    "deepspeed_zero_bytes",
    "device_footprint",
    "dry_run",
    "expected_fixed_cost",
    "explain_fixed_cost",
    "format_table",
    "fsdp_fixed_cost_bytes",
    "fsdp_gathered_bytes",
    "korthikanti_bytes",
    "largest_batch_size",
    "parse_bytes",
    "predict",
    "source_for",
    "summary_markdown",
    "sweep",
    "take_census",
    "zero_state_bytes",
]
