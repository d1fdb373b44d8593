"""`python -m jobs.train_dmtd [CONFIG.yaml] [key=value ...]` (`esp-batch train-dmtd`); the code is in jobs/train/dmtd.py."""
import sys

from .train.dmtd import main

if __name__ == "__main__":
    sys.exit(main())
