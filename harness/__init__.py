"""The measuring side of the suite: what runner.py runs and how each number is made.

plan (which configurations and providers), sweep (jobs x providers -> rows, failures as rows),
deadline (each provider call's --call-timeout),
accuracy (every job against the float64 reference before it is timed), timing (the one clock),
results (the row schema, the CSV writer and loader, results.json), io (atomic writes, the
folder lock), provider_file (--provider-file), regression and calibrate (--compare's rule
and its noise), ncu and ncu_target (Nsight Compute), stages (a run's order: sweep, counters,
regression, reports), reproduce (--reproduce targets). Rendering lives in reports/.
"""
