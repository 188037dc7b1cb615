"""`dspark-sidecar bench` defaults shared by cli.py's flags and bench.BenchConfig, written once here.

A module of its own because bench.py imports torch, and the command line must build its parser (and
print `--help`) without it; BenchConfig, which needs bench.py's imports, takes its defaults from here.
"""

from __future__ import annotations

P99_MIN_SAMPLES = 100  # below it a nearest-rank p99 is the maximum: reported as such (bench._latency_fields)
REPEATS = P99_MIN_SAMPLES  # timed steps per mode and case: enough that every row's p99 is one
