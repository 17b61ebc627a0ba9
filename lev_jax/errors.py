"""Errors the library raises on purpose (callers map these to clear messages / HTTP 4xx)."""


class CheckpointError(ValueError):
    """A checkpoint that cannot be loaded: missing, unexpected or mis-shaped tensors, a corrupt file."""
