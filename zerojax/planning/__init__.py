"""Before anything runs: the analytic estimate (`estimate`, no jax), one compiled peak and one
guard (`memory`), the planner's ranked plans (`planner`), the mesh search (`mesh_search`) and the
measured matmul ceiling MFU is counted against (`ceiling`). Builds on `zerojax.train`, never the
reverse."""
