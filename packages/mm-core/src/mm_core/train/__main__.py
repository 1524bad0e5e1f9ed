"""``torchrun --nproc_per_node N -m mm_core.train CFG [key=value ...]`` (for existing launch scripts)."""

import sys

from mm_core.train.entry import run_worker

if __name__ == "__main__":
    sys.exit(run_worker(sys.argv[1:]))
