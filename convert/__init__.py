"""dist_glm5.convert"""
