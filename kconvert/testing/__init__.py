"""Tiny, deterministic Kimi-shaped checkpoints and the trained tiny MoE's data and evaluation,
for kconvert's tests and benchmarks and for trying kconvert out without a 600 GB download."""



