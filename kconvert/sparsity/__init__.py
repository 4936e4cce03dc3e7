"""Sparsity patterns and the methods that choose them: paired-4:8 masks and checks, and
SparseGPT's joint prune + quantize loop (docs/p48.md)."""



