"""Training the CP multi-token heads of `engine.method=cp_heads` on Ray Train (heads.py,
`python -m jobs.train_heads`, `esp-batch train-heads`)."""
