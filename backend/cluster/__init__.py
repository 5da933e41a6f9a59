"""Nodes and what runs on them: the node inventory, SSH, the remote shell, pre-flight, the bandwidth test, launch, admission."""
