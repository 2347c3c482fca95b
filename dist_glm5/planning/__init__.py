"""Planning, computed not measured: stage partition, per-worker memory, cluster fit, expert
placement."""
