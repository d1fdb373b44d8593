"""`python -m jobs.train_heads [CONFIG.yaml] [key=value ...]`: kept so the command works as before; the code is in jobs/train/heads.py."""
import sys

from .train.heads import main

if __name__ == "__main__":
    sys.exit(main())
