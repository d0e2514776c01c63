"""Command-line entry points (`specblock-train`, `specblock-bench`, regeneration) and the benchmark harness."""
