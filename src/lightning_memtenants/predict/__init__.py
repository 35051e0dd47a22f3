"""Predict: a training step run under fake tensors through the same monitor, for the CPU or a modelled GPU."""
