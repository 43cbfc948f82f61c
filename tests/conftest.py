import os
import sys

from hypothesis import HealthCheck, settings

# The real-engine suite runs in its own environment (make real-engine-test: vLLM's CPU build serving
# a real model); the main suite's environment (vLLM for CUDA) does not collect it.
if os.environ.get("CACHESCOUT_REAL_ENGINE") != "1":
    collect_ignore_glob = ["real_engine/*"]

sys.path.insert(0, os.path.dirname(__file__))

settings.register_profile("ci", max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
settings.register_profile("dev", max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
settings.load_profile("ci" if os.environ.get("CI") else "dev")


# -- a real redis-server on 127.0.0.1 -------------------------------------------------------------
import random  # noqa: E402
import shutil  # noqa: E402
import signal  # noqa: E402
import socket  # noqa: E402
import subprocess  # noqa: E402
import tempfile  # noqa: E402
import time  # noqa: E402

import pytest  # noqa: E402


class RedisServer:
    """A redis-server process of our own on a free loopback port; no persistence unless `aof`.

    Faults for tests: `kill9()` then `start()` again (same port, same data directory), `pause()` /
    `resume()` (SIGSTOP / SIGCONT)."""

    def __init__(self, *, aof: bool = False, workdir: str | None = None, extra: list[str] | None = None,
                 port: int | None = None, scheme: str = "redis") -> None:
        self.port = port if port is not None else free_port()
        self.url = f"{scheme}://127.0.0.1:{self.port}"
        self.aof = aof
        self.workdir = workdir
        self.extra = list(extra or [])
        self.proc: subprocess.Popen | None = None
        self.start()

    def args(self) -> list[str]:
        args = ["redis-server", "--bind", "127.0.0.1", "--save", ""]
        if "--tls-port" in self.extra:
            args += ["--port", "0"]
        else:
            args += ["--port", str(self.port)]
        args += ["--appendonly", "yes", "--appendfsync", "always"] if self.aof else ["--appendonly", "no"]
        if self.workdir:
            args += ["--dir", self.workdir]
        return args + self.extra

    def start(self, *, timeout_s: float = 30.0, attempts: int = 2) -> None:
        """Start (or restart after `kill9`) and wait until it answers PING.

        A start that gives no sign of life is tried once more: on a loaded CI machine (a real vLLM
        server busy on every core) one restart after kill -9 once printed nothing at all within 10 s.
        The restart is the test's own fault injection, not what is under test."""
        failures = []
        for _ in range(attempts):
            why = self._start_once(timeout_s)
            if why is None:
                return
            failures.append(why)
        raise RuntimeError(f"redis-server on port {self.port} did not start: " + " || ".join(failures))

    def _start_once(self, timeout_s: float) -> str | None:
        # redis-server logs to stdout; kept (unlinked file) so that a failed start says why.
        with tempfile.TemporaryFile() as log:
            began = time.monotonic()
            self.proc = subprocess.Popen(self.args(), stdout=log, stderr=subprocess.STDOUT)
            while not self._answers():
                code = self.proc.poll()
                if code is not None or time.monotonic() - began > timeout_s:
                    self.stop()
                    log.seek(0)
                    tail = log.read().decode(errors="replace").strip().splitlines()[-5:]
                    return (f"after {time.monotonic() - began:.1f} s, exit code {code}, "
                            f"log: {' | '.join(tail) or '(empty)'}")
                time.sleep(0.05)
        return None

    def _answers(self) -> bool:
        try:
            with socket.create_connection(("127.0.0.1", self.port), timeout=0.2):
                if "--tls-port" in self.extra:
                    return True
            with socket.create_connection(("127.0.0.1", self.port), timeout=0.2) as c:
                c.sendall(b"PING\r\n")
                return c.recv(64).startswith((b"+PONG", b"-NOAUTH"))
        except OSError:
            return False

    def kill9(self) -> None:
        self.proc.send_signal(signal.SIGKILL)
        self.proc.wait(5)

    def pause(self) -> None:
        self.proc.send_signal(signal.SIGSTOP)

    def resume(self) -> None:
        self.proc.send_signal(signal.SIGCONT)

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGCONT)
            self.proc.terminate()
            try:
                self.proc.wait(5)
            except subprocess.TimeoutExpired:
                self.proc.kill()


def free_port() -> int:
    """A free loopback port below the kernel's ephemeral range.

    A port the kernel handed out (bind to 0) is an ephemeral one: while a test's redis-server is
    killed, any outgoing connection on the machine (a client retrying that very port included, by
    TCP self-connect) may take it as its local port, and the restart then fails with "address in
    use". Ports below the ephemeral range are never given to outgoing connections."""
    low = 32768
    try:
        with open("/proc/sys/net/ipv4/ip_local_port_range") as f:
            low = int(f.read().split()[0])
    except (OSError, ValueError, IndexError):
        pass
    rng = random.Random()
    for _ in range(200):
        port = rng.randrange(max(1024, low // 2), max(1025, low))
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", port))
            except OSError:
                continue
            return port
    raise RuntimeError("no free loopback port below the ephemeral range")


def make_certs(d: str) -> None:
    """A private CA (ca.crt) and a certificate for 127.0.0.1 signed by it (server.crt, server.key) in `d`."""
    need_tool("openssl")

    def run(*args: str) -> None:
        subprocess.run(["openssl", *args], cwd=d, check=True, capture_output=True)
    run("req", "-x509", "-newkey", "rsa:2048", "-nodes", "-keyout", "ca.key", "-out", "ca.crt", "-days", "2",
        "-subj", "/CN=cachescout-test-ca")
    run("req", "-newkey", "rsa:2048", "-nodes", "-keyout", "server.key", "-out", "server.csr",
        "-subj", "/CN=127.0.0.1")
    with open(os.path.join(d, "san.ext"), "w") as f:
        f.write("subjectAltName=IP:127.0.0.1\n")
    run("x509", "-req", "-in", "server.csr", "-CA", "ca.crt", "-CAkey", "ca.key", "-CAcreateserial",
        "-out", "server.crt", "-days", "2", "-extfile", "san.ext")


def tls_files(d: str) -> list[str]:
    """redis-server options serving TLS with the certificates of `make_certs(d)`."""
    return ["--tls-cert-file", os.path.join(d, "server.crt"), "--tls-key-file", os.path.join(d, "server.key"),
            "--tls-ca-cert-file", os.path.join(d, "ca.crt"), "--tls-auth-clients", "no"]


def tls_redis(d: str) -> RedisServer:
    """A redis-server speaking only TLS (rediss://), its certificates made in `d`."""
    need_redis()
    make_certs(d)
    port = free_port()
    return RedisServer(port=port, scheme="rediss", extra=["--tls-port", str(port), *tls_files(d)])


def need_tool(name: str) -> None:
    """Skip a test whose command-line tool is missing here; under CI (which installs it) fail."""
    if shutil.which(name) is None:
        if os.environ.get("CI"):
            pytest.fail(f"{name} is missing: .ci/run installs it")
        pytest.skip(f"{name} is not installed")


def need_redis() -> None:
    need_tool("redis-server")


@pytest.fixture
def redis_server():
    need_redis()
    server = RedisServer()
    yield server
    server.stop()


# -- what each test needs, as markers (`make unit`: only the unit tests, a few minutes) ------------------
_VLLM_MODULES = {"test_connector_vllm", "test_lmcache_tier", "test_lmcache_cpu"}   # vLLM's or LMCache's code
_REDIS_MODULES = {"test_shared_state", "test_shared_state_deploy"}                 # a real redis-server
_DEPLOY_MODULES = {"test_deploy"}                                                  # Helm's SDK, validators


def pytest_collection_modifyitems(config, items):
    for item in items:
        module = item.module.__name__.rpartition(".")[2] if item.module else ""
        needs = set()
        if "real_engine" in str(item.path):
            needs.add("real_engine")
        if module in _DEPLOY_MODULES:
            needs.add("deploy")
        if module in _VLLM_MODULES or "vllm" in item.name:
            needs.add("vllm")
        if module in _REDIS_MODULES or "redis_server" in getattr(item, "fixturenames", ()):
            needs.add("redis")
        for name in needs or {"unit"}:
            item.add_marker(name)
