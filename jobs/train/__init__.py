"""Training on Ray Train: the CP multi-token heads of `engine.method=cp_heads` (heads.py, `esp-batch train-heads`)
and DMTD models and copies (dmtd.py, `esp-batch train-dmtd`), sharing data, schedule, checkpoints and resume
(common.py)."""
