"""Run metrics: sinks (metrics.jsonl), train-inference mismatch, routing agreement, GPU stats, plots."""
