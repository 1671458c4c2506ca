"""Benchmarks and checks, run from the repository's root as modules (`python -m benchmarks.bench moe ...`,
`torchrun --nproc_per_node 2 -m benchmarks.comm_report ...`): bench (layers, kernels, a training step), scaling
(the sweep and the performance model's predictions), comm_report (each layer's measured communication), gpu_check
(what a first run on a CUDA GPU must prove), tb_report (a run's TensorBoard figures in one PNG). One-off studies
behind docs/ pages live in studies/. Nothing here is installed with moe_dist.
"""
