"""Errors of loading and preparing a model (one line each, for the job's exit message)."""


class ModelLoadError(ValueError):
    """A model could not be loaded; the message says why and what to do."""
