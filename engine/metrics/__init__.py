"""What a worker measures about itself: per-step work and timing (step_stats.py), the bytes and
FLOPs a step moves (roofline.py) against the machine's peak (peak.py), and the Prometheus
registry served at the worker's /metrics (worker_metrics.py)."""
