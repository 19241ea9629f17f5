"""The per-job control plane: the job's Redis, its store of keys, the event log, the
node agents and the master (see DESIGN.md, "The online path")."""
