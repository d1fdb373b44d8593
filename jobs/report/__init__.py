"""Human-readable reports: the job report (job_report.py, `esp-batch report`), the plotting helpers it
shares with the benchmark's report (plots.py), and training loss curves (loss_plot.py)."""
