"""dist_glm5.stages"""
