"""`esp-batch export OUTPUT_DIR FILE --format spec-bench`: a job's output in other tools' answer-file formats."""
