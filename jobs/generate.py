"""`python -m jobs.generate [CONFIG.yaml] [key=value ...]`: kept so the command works as before; the code is in jobs/run/generate.py."""
import sys

from .run.generate import main

if __name__ == "__main__":
    sys.exit(main())
