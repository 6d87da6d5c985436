"""`python -m lm.cli ...`, as the sbatch template and bench/gpu.sh run lm: the same as the `lm` command."""

import sys

from lm.cli import main

sys.exit(main())
