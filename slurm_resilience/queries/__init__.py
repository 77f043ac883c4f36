"""Questions a login node asks the node agents: a job's goodput records and hang reports.

Each agent keeps its node's part of a job in its own root-only state; a command run where
no agent is (a login node) asks the agents of the job's nodes over their metrics HTTP
endpoint. Each question carries a munge credential of the asker, sealed for root (only the
agent can open it) over the exact question (``query v1 <kind> job <id> node <node>``), so
it can't be replayed for another job or node, and munged refuses it a second time.
"""
