"""Collectors: do the I/O, return plain JSON-serialisable snapshots, judge nothing."""
