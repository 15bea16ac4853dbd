"""Laneformer (model_type `laneformer_tp`): Kog's latency-first model with one residual stream
per lane and Delayed Tensor Parallelism. See docs/laneformer.md."""
