"""The streaming engine: plan every output byte, then read -> compute -> write in a pipeline.

1. `build_work_plan` turns the source's tensors and the stages into output tensors, output shard
   headers and a list of work items: copy items (byte ranges of tensors that pass through,
   at most COPY_CHUNK each) and transform items (a few fused sets of one layer and role,
   sized so their fp32 decode fits `work_elems`).
2. `execute` runs the items: reader threads fill host buffers ahead (bounded prefetch), the
   calling thread decodes/transforms/encodes on the chosen device, one writer thread
   `pwrite`s results into planned `.partial` files while a hasher thread hashes them, and
   each shard is renamed into place the moment its last byte is written, its hashes
   recorded under `.kconvert/done/`.
Memory is bounded by (prefetch + queue) items, never by shard or model size. On a CPU run the
reader, writer and hasher threads get cores of their own (`split_cores`), the kernels the rest.

Modules: items.py (the plan and its items), work.py (building it, sharing it among ranks),
compute.py (read_item, compute_item), sink.py (ShardSink: partial files, hashes, rename on
complete), execute.py (the threads, the knobs).
Every step of every item is a timing event (kconvert.common.events) for benchmarks and tests that
subscribe with `timings=True`; with no such listener nothing is timed.
"""
