"""lightning-memtenants: what is using your training memory, tenant by tenant."""

from lightning_memtenants.alerts import LeakDetector, MemoryBudgetError
from lightning_memtenants.callback import MemoryTenantsCallback
from lightning_memtenants.census import TENANTS, ActivationTracker, TenantCounter, take_census
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

__all__ = [
    "PHASES",
    "TENANTS",
    "AcceleratorSource",
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
    "Reading",
    "StepReport",
    "TenantCounter",
    "TenantMonitor",
    "TrackerSource",
    "expected_fixed_cost",
    "explain_fixed_cost",
    "format_table",
    "parse_bytes",
    "source_for",
    "take_census",
]
