"""dist-glm5: serving the GLM-5 family (MLA + DSA, MoE, MTP) in MXFP4; the CPU backend is the
reference."""

__version__ = "0.1.0"
