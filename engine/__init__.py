"""The control plane: what runs the engine, torch-free (tests/test_layout.py holds it so).

config (EngineConfig and its parts), scheduler (the queue; it keeps the block ledger), messages
(what crosses to and from the stages), pipeline (the protocol a pipeline implements), coordinator
(plans out, results in, detokenised), loop (the engine thread a server or batch job drives) and
metrics. The torch workers that run the plans live in stages/. Two torch-free leaves stay under the
model because the model's own code uses them too and must not import upward: the block ledger
(model/block_manager.py, which a standalone cache keeps as well) and DSAConfig."""
