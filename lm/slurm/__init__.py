"""SLURM: sbatch scripts rendered from a run's config (submit), the state of a run's jobs (status). The sbatch template,
the site example and the local test cluster's script are in the top-level slurm/ folder."""
