"""SLURM: sbatch scripts rendered from a run's config (submit), the state of a run's jobs (status), and a real
one-node cluster for trying it here (local_cluster.sh)."""
