"""Fixtures for agent.py's tests: a fake Claude Code CLI and a harness that runs real agents."""
