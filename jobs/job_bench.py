"""`python -m jobs.job_bench`: kept so the command works as before; the code is in jobs/bench/job_bench.py."""
import sys

from .bench.job_bench import main

if __name__ == "__main__":
    sys.exit(main())
