"""Checks: pure functions ``(snapshot, settings, previous state) -> CheckResult``."""
