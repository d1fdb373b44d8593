"""The model: loading (local path, hub id, tiny and random test models), the runner that feeds one block through
the layers, the direct layer loop, compiled layers and the trained multi-token heads."""
