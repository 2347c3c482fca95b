"""The default model's trainer and its corpus (`dist-glm5 bench train-default` runs it): trainer.py
trains the shipped weights with transformers' GLM-5 model, corpus.py makes its documents and the
held-out slice, hf.py makes the copy of a checkpoint transformers loads."""
