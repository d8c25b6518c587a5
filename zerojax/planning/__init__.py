"""Before anything runs: the analytic estimate (`estimate`, no jax), the planner's ranked plans
(`planner`), the mesh search (`mesh_search`) and the measured matmul ceiling MFU is counted against
(`ceiling`). The compiled peak and the guard the engine runs are `zerojax.engine.memory` (also
reachable as `planning.memory`). Builds on `zerojax.engine`, never the reverse."""
