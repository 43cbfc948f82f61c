"""Workloads, the replay harness and the `cachescout` command line.

The replay engine's hot modules run compiled when the policy core's do (see `cachescout.policy`)."""

from cachescout.policy import compiled_first

compiled_first(__path__)  # noqa: F821 (the package's search path)
