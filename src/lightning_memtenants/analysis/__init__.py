"""Analyse: the fixed-cost formulas, the sentences that explain a record, the forecast, leaks and fixes."""
