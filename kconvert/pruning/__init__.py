"""Expert pruning, a library the prune stage (kconvert.stages.prune) uses and which imports no
stage: pruning plans (which experts each MoE layer keeps), REAP scoring and router repair."""



