"""Benchmarks: one module per `rvqtts bench` command, over one harness (rvqtts.bench.harness)."""
