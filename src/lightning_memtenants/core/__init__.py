"""Measure: storages, the tenant census, the live-tensor tracker, the memory sources, and the record they fill."""
