"""engine.cuda_graphs: the device work of a decode pass as a pure function of static buffers (`step.py`), its
buffers and shape classes (`buffers.py`), and the runner that captures and replays it per class (`runner.py`)."""
