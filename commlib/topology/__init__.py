"""Topology discovery: see the topology issue."""
