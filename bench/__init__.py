"""Workloads, the replay harness and the `cachescout` command line."""
