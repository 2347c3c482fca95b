"""dist_glm5.kernels"""
