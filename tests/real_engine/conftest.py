"""The real-engine suite runs in its own environment (make real-engine-test): vLLM's CPU build
serving a real model. The main suite's environment (vLLM 0.33 for CUDA) does not collect it."""

import os

if os.environ.get("CACHESCOUT_REAL_ENGINE") != "1":
    collect_ignore_glob = ["test_*.py"]
