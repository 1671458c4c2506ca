"""One-off studies behind figures of docs/ (run from the repository's root as `python -m benchmarks.studies.NAME`):
expert balancing recipes, checkpoint save/load cost, context parallelism of the recurrent layers, gradient-reduction
overlap, memory plan against measured peaks, the pipeline bubble."""
