"""Standalone scripts run inside a deployment engine's own environment (see quantlab.toolenv).
They import only the engine and numpy/torch, never quantlab: ids in, negative log-likelihoods out."""
