"""Prolog, epilog and HealthCheckProgram entry points (see ``hooks/`` for the wrappers)."""
