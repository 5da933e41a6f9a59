"""What the nodes report: the node agent, ingest, alert rules, log causes, queries, export."""
