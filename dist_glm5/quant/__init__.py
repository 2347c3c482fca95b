"""Quantisation formats: the MXFP4 codec (Quark and OCP rules); int8 indexer keys."""
