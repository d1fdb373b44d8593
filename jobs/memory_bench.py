"""`python -m jobs.memory_bench`: kept so the command works as before; the code is in jobs/bench/memory_bench.py."""
import sys

from .bench.memory_bench import main

if __name__ == "__main__":
    sys.exit(main())
