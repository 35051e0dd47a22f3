"""lightning-memtenants: what is using your training memory, tenant by tenant."""

from lightning_memtenants.alerts import LeakDetector, MemoryBudgetError
from lightning_memtenants.callback import MemoryTenantsCallback
from lightning_memtenants.census import TENANTS, ActivationTracker, TenantCounter, take_census
from lightning_memtenants.dryrun import Prediction, dry_run, largest_batch_size, predict, sweep
from lightning_memtenants.forecast import PeakForecast, parse_bytes
from lightning_memtenants.formulas import FixedCost, expected_fixed_cost, explain_fixed_cost
from lightning_memtenants.monitor import TenantMonitor
from lightning_memtenants.report import PHASES, PhaseReport, StepReport, format_table
from lightning_memtenants.sources import (
    AcceleratorSource,
    CudaSource,
    MemorySource,
    MpsSource,
    Reading,
    TrackerSource,
    source_for,
)
from lightning_memtenants.tracker import LiveTensorTracker
from lightning_memtenants.transformer import ActivationCheck, activation_check, korthikanti_bytes

__all__ = [
    "PHASES",
    "TENANTS",
    "AcceleratorSource",
    "ActivationCheck",
    "ActivationTracker",
    "CudaSource",
    "FixedCost",
    "LeakDetector",
    "LiveTensorTracker",
    "MemoryBudgetError",
    "MemorySource",
    "MemoryTenantsCallback",
    "MpsSource",
    "PeakForecast",
    "PhaseReport",
    "Prediction",
    "Reading",
    "StepReport",
    "TenantCounter",
    "TenantMonitor",
    "TrackerSource",
    "activation_check",
    "dry_run",
    "expected_fixed_cost",
    "explain_fixed_cost",
    "format_table",
    "korthikanti_bytes",
    "largest_batch_size",
    "parse_bytes",
    "predict",
    "source_for",
    "sweep",
    "take_census",
]
