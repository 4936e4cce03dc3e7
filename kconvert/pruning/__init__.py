"""Expert pruning: pruning plans (which experts each MoE layer keeps) and REAP scoring."""



