"""`python -m jobs.bench [CONFIG.yaml] [key=value ...]`: see jobs/bench/runner.py."""
import sys

from .runner import main

sys.exit(main())
