"""lightning-memtenants: what is using your training memory, tenant by tenant."""

from lightning_memtenants.callback import MemoryTenantsCallback
from lightning_memtenants.census import TENANTS, ActivationTracker, take_census
from lightning_memtenants.formulas import FixedCost, expected_fixed_cost, explain_fixed_cost
from lightning_memtenants.monitor import TenantMonitor
from lightning_memtenants.report import PHASES, PhaseReport, StepReport, format_table

__all__ = [
    "PHASES",
    "TENANTS",
    "ActivationTracker",
    "FixedCost",
    "MemoryTenantsCallback",
    "PhaseReport",
    "StepReport",
    "TenantMonitor",
    "expected_fixed_cost",
    "explain_fixed_cost",
    "format_table",
    "take_census",
]
