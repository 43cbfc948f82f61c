"""The `cachescout` command: `config` and `state` for operators, `bench` for the benchmark.

`cachescout bench` imports the benchmark only when it runs, so an environment without it (the
serving image) still has the operator commands."""
