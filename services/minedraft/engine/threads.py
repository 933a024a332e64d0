"""Moved to `minedraft.engine.adaptive.threads`; this name stays for the worker nodes that import it."""

from minedraft.engine.adaptive.threads import StepKind, StepThreads, ThreadCounts

__all__ = ["StepKind", "StepThreads", "ThreadCounts"]
