"""CPU–device execution: the cost model, the planner that splits each MoE step across paths, microbenchmarks."""
