"""kconvert's benchmarks and quality measurements: `python -m benchmarks` lists them,
`python -m benchmarks NAME [ARGS]` runs one. They share one harness (benchmarks.harness: what a
result records, its name, the timer, the page-cache drop, the shared options;
benchmarks.child_process: the child-process runner; benchmarks.gpu_sampler: the GPU sampled
meanwhile) and one module of synthetic Kimi-K2 shard sets (benchmarks.synthetic). Not part of
the kconvert wheel. Results and what they measured: benchmarks/results/README.md."""
