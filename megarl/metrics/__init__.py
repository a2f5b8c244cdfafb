"""Run metrics: sinks (metrics.jsonl, TensorBoard), train-inference mismatch, routing agreement, GPU stats, plots."""
