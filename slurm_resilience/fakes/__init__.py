"""Stand-ins for the hardware edge (NVML, sysfs, the kernel log), faithful to the real formats.

They exist for the sandbox and tests; nothing else in the package imports them
unless the configuration selects ``health.backend: fake``.
"""
