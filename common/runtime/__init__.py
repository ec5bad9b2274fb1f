"""Leaf utilities every part of the code may use; they import nothing else of common/: logging and console verbosity,
CPU pinning and signals (process.py), Prometheus, retry back-off, failure kinds and exit codes, heartbeats, private
directories."""
