"""Observability: the step profiler (installed as hooks from outside the model), peak memory."""
