"""engine.compile_host: host-side work of a pass compiled ahead of time (AOTInductor)."""
