"""Runs: the state machine with compare-and-set (lifecycle), the watch of a run's nodes, the manager facade."""
