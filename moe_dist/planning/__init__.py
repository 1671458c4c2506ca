"""Planning a job before it runs, from the config alone: memory.py (the per-rank memory plan of
`launch/train.py --dry-run`, docs/memory.md), perfmodel.py (the α–β model of a step's time, docs/perf_model.md;
its collectives' cost in collectives.py, the step's FLOPs and collectives in workload.py),
fit.py (calibrating that model on measured runs, benchmarks/scaling.py) and cluster.py (its H200 predictions)."""
