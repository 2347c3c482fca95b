"""Model math: GLM-5 (MLA + DSA indexer, sigmoid grouped router, MoE, MTP) over a paged cache.

Pure math: no distribution (applied from outside by stages/tp.py), no profiler (hooks from
dist_glm5/obs), no messages. Reads like the paper."""
