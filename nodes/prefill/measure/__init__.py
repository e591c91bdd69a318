"""`tandem bench prefill` and its comparisons: one pass of many prompts, the table,
accelerate's offload."""
