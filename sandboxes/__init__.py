"""Where a session's processes run: the protocol (``sandboxes.base``), the providers (``local``, ``slurm``,
``ecs``), the in-sandbox agent and supervisor, workspace lay-out. Nothing is imported here: the supervisor
and the agent import their neighbours by name inside a sandbox, and a caller pays only for what it uses."""
