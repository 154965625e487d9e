"""Helpers for tests and benchmarks that need real servers on 127.0.0.1 (torch-free)."""
