"""Several processes: `zerojax launch` (`launcher`, DeepSpeed's launcher flags) and
`init_distributed` (`distributed`: SLURM, MPI, Kubernetes, DeepSpeed's environment)."""
