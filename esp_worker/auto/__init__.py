"""block_complexity=auto: the per-pass block-size policy, the cost curve it reads, and the small protocol a
drafter implements to be sized (`DraftSizer`)."""
