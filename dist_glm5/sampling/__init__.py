"""Sampling: per-request parameters (params.py imports no torch), the reference sampler, the
one-draft rejection sampler for MTP."""
