"""The whole training step as one graph: ``compile_step`` (``whole_step.py``) and the optimizer's
update traced into it (``optimizer_step.py``; the update op itself is ``ops/fused_update.py``)."""
