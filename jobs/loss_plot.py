"""`python -m jobs.loss_plot`: kept so the command works as before; the code is in jobs/report/loss_plot.py."""
import sys

from .report.loss_plot import main

if __name__ == "__main__":
    sys.exit(main())
