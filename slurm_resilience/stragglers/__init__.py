"""Straggler naming: members (ranks of a node, or nodes of a job) persistently slower than
the rest of their job, judged with robust statistics over a window of step times."""
