"""Routing traces to training data, learned per-layer predictors, baselines, ONNX export and run."""
