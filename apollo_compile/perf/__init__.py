"""The performance model (``model.py``: a subgraph's time alone, on a lane beside others, under an SM
quota) and its calibration from the times the CUDA-graph runners measure (``perf/calibration.py``)."""
