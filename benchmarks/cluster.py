"""Emulated cluster: N nodes, each a network namespace with a veth into a bridge, links shaped to a profile.

    python -m benchmarks.cluster probe --profile ethernet-1g
    python -m benchmarks.cluster run --nodes 4 --profile ethernet-1g -- \\
        python -m benchmarks.synthetic --model alexnet --method terngrad

Profiles: ethernet-1g (1 Gbit/s, tbf, on both directions of every node's link, plus 0.1 ms delay where
the kernel has sch_netem), fast (unshaped veth; labeled with its measured bandwidth, and no InfiniBand),
or custom: --rate 500mbit --delay-us 200.

mpirun runs in the root namespace and starts one rank per node (--ranks-per-node: several) through an rsh
agent that enters the node's namespace, with MPI's TCP traffic pinned to the cluster subnet, so every byte
between nodes crosses the shaped links; ranks of one node talk through shared memory (--mca btl
tcp,self,vader), as GPUs of one machine would over its fast links. Node i runs on core i mod (cores), so
the nodes share this machine's cores evenly (--no-pin lets them float). The emulator only creates and deletes
its own namespaces, veths and bridge (named with a per-run tag), and it always cleans up: on exit, on
error and on Ctrl-C/SIGTERM. It needs root and network-namespace support, and says so when they are missing.
"""
from __future__ import annotations

import argparse
import contextlib
import json
import os
import random
import shutil
import signal
import subprocess
import sys
import tempfile
import textwrap
import threading
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


@dataclass(frozen=True)
class Profile:
    name: str
    rate: str | None  # tc rate, e.g. "1gbit"; None = unshaped
    delay_us: int = 0


PROFILES = {
    "ethernet-1g": Profile("ethernet-1g", "1gbit", 100),
    "fast": Profile("fast", None, 0),
}


def init_gloo(hvd, port: int | None = None) -> None:
    """torch.distributed's gloo group over Horovod's ranks (hvd initialized), for the DDP methods beside
    Horovod's: at MASTER_ADDR (the cluster sets node 0's) and `port`, else MASTER_PORT, else 29533."""
    import torch.distributed as dist

    addr = os.environ.get("MASTER_ADDR", "127.0.0.1")
    port = port or int(os.environ.get("MASTER_PORT", "29533"))
    dist.init_process_group("gloo", init_method=f"tcp://{addr}:{port}", rank=hvd.rank(), world_size=hvd.size())


class ClusterUnavailable(RuntimeError):
    """This machine cannot host the emulated cluster (no root, no netns, no tc)."""


def _run(cmd: list[str], check=True, **kw) -> subprocess.CompletedProcess:
    res = subprocess.run(cmd, capture_output=True, text=True, **kw)
    if check and res.returncode != 0:
        raise RuntimeError(f"{' '.join(cmd)} failed: {res.stderr.strip() or res.stdout.strip()}")
    return res


def _collect(stream, lines: list[str], echo) -> None:
    """Read a job's output to its end into lines, writing each line to echo (if given) as it comes."""
    for line in stream:
        lines.append(line)
        if echo is not None:
            echo.write(line)
            echo.flush()


def check_support() -> None:
    if os.geteuid() != 0:
        raise ClusterUnavailable("the emulated cluster needs root (network namespaces, veth, tc)")
    for tool in ("ip", "tc", "mpirun"):
        if shutil.which(tool) is None:
            raise ClusterUnavailable(f"the emulated cluster needs '{tool}' (apt-get install iproute2 openmpi-bin)")
    probe = f"hvdtg-probe-{os.getpid()}"
    res = _run(["ip", "netns", "add", probe], check=False)
    if res.returncode != 0:
        raise ClusterUnavailable(f"network namespaces are not allowed here: {res.stderr.strip()}")
    _run(["ip", "netns", "del", probe], check=False)


def netem_available() -> bool:
    name = f"tgq{os.getpid() % 100000}"
    if _run(["ip", "link", "add", name, "type", "veth", "peer", "name", name + "p"], check=False).returncode:
        return False
    try:
        return _run(["tc", "qdisc", "add", "dev", name, "root", "netem", "delay", "100us"], check=False).returncode == 0
    finally:
        _run(["ip", "link", "del", name], check=False)


class EmulatedCluster:
    """Context manager: `with EmulatedCluster(4, PROFILES["ethernet-1g"]) as c: c.run([...])`."""

    def __init__(self, nodes: int, profile: Profile, pin: bool = True, ranks_per_node: int = 1):
        if nodes < 1 or nodes > 200:
            raise ValueError(f"nodes must be in [1, 200], got {nodes}")
        if ranks_per_node < 1:
            raise ValueError(f"ranks_per_node must be >= 1, got {ranks_per_node}")
        self.nodes = nodes
        self.ranks_per_node = ranks_per_node
        self.profile = profile
        # Node i runs on core cpus[i % len(cpus)]. Unpinned, the scheduler moves N ranks and their Horovod
        # threads across the shared cores unevenly, and compute time varies twofold from run to run; pinned,
        # each node gets the even share a dedicated node would (figures: docs/clusters.md).
        self.cpus = sorted(os.sched_getaffinity(0)) if pin else None
        self.tag = f"{os.getpid() % 10000:04d}{random.randint(0, 99):02d}"
        self.bridge = f"tgb{self.tag}"
        self.subnet = self._free_subnet()
        self.created_ns: list[str] = []
        self.created_links: list[str] = []
        self.netem = False
        self.workdir = Path(tempfile.mkdtemp(prefix=f"hvdtg-cluster-{self.tag}-"))
        self._old_handlers = {}
        self._jobs: list[subprocess.Popen] = []  # running mpirun process groups, killed by cleanup()
        self._link_gbps: float | None = None  # the link transport="auto" is told of, once known

    # names -----------------------------------------------------------------------------------
    def ns(self, i: int) -> str:
        return f"hvdtg-{self.tag}-{i}"

    def host_if(self, i: int) -> str:
        return f"tgh{self.tag}{i}"

    def ip(self, i: int) -> str:
        return f"{self.subnet}.{i + 1}"

    def _free_subnet(self) -> str:
        used = _run(["ip", "-o", "-4", "addr"], check=False).stdout
        for _ in range(100):
            cand = f"10.213.{random.randint(1, 250)}"
            if f" {cand}." not in used:
                return cand
        raise ClusterUnavailable("no free 10.213.x.0/24 subnet")

    # lifecycle -------------------------------------------------------------------------------
    def __enter__(self):
        check_support()
        for sig in (signal.SIGINT, signal.SIGTERM):
            self._old_handlers[sig] = signal.signal(sig, self._on_signal)
        try:
            self._create()
        except BaseException:
            self.cleanup()
            raise
        return self

    def __exit__(self, *exc):
        self.cleanup()
        for sig, h in self._old_handlers.items():
            signal.signal(sig, h)
        return False

    def _on_signal(self, signum, frame):
        self.cleanup()
        raise KeyboardInterrupt(f"signal {signum}: emulated cluster cleaned up")

    def _create(self):
        _run(["ip", "link", "add", self.bridge, "type", "bridge"])
        self.created_links.append(self.bridge)
        _run(["ip", "addr", "add", f"{self.subnet}.254/24", "dev", self.bridge])
        _run(["ip", "link", "set", self.bridge, "up"])
        use_netem = self.profile.delay_us > 0 and netem_available()
        self.netem = use_netem
        for i in range(self.nodes):
            ns, hif, pif = self.ns(i), self.host_if(i), f"tgp{self.tag}{i}"
            _run(["ip", "netns", "add", ns])
            self.created_ns.append(ns)
            _run(["ip", "link", "add", hif, "type", "veth", "peer", "name", pif])
            self.created_links.append(hif)
            _run(["ip", "link", "set", pif, "netns", ns])
            _run(["ip", "link", "set", hif, "master", self.bridge, "up"])
            nsx = ["ip", "netns", "exec", ns]
            _run([*nsx, "ip", "link", "set", pif, "name", "eth0"])
            _run([*nsx, "ip", "addr", "add", f"{self.ip(i)}/24", "dev", "eth0"])
            _run([*nsx, "ip", "link", "set", "eth0", "up"])
            _run([*nsx, "ip", "link", "set", "lo", "up"])
            if self.profile.rate:
                for dev_cmd in (["tc"], [*nsx, "tc"]):
                    dev = hif if dev_cmd == ["tc"] else "eth0"
                    _run([*dev_cmd, "qdisc", "add", "dev", dev, "root", "handle", "1:", "tbf", "rate",
                          self.profile.rate, "burst", "256kb", "latency", "50ms"])
                    if use_netem:
                        _run([*dev_cmd, "qdisc", "add", "dev", dev, "parent", "1:1", "handle", "10:", "netem",
                              "delay", f"{self.profile.delay_us // 2}us"])
        agent = self.workdir / "netns-agent.sh"
        lines = ["#!/bin/bash",
                 "# rsh agent for mpirun: run the command in the namespace of the node whose address is $1, with",
                 "# its own hostname (a UTS namespace), so that Open MPI sees distinct nodes.",
                 "host=$1; shift",
                 'case "$host" in']
        pin = (lambda i: f"taskset -c {self.cpus[i % len(self.cpus)]}") if self.cpus else (lambda i: "")
        lines += [f"  {self.ip(i)}) ns={self.ns(i)}; name=node{i}; pin='{pin(i)}' ;;" for i in range(self.nodes)]
        lines += ['  *) echo "netns-agent: unknown host $host" >&2; exit 1 ;;', "esac",
                  "# $pin: the node's core, inherited by the daemon and the rank it starts",
                  'exec ip netns exec "$ns" unshare --uts $pin /bin/sh -c "hostname $name && $*"']
        agent.write_text("\n".join(lines) + "\n")
        agent.chmod(0o755)
        self.agent = agent

    def cleanup(self):
        for proc in self._jobs:  # first the jobs: mpirun runs in its own session, so kill its group
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGKILL)
            with contextlib.suppress(subprocess.TimeoutExpired):
                proc.wait(timeout=10)
        self._jobs.clear()
        self._kill_daemons()
        for ns in reversed(self.created_ns):
            _run(["ip", "netns", "del", ns], check=False)
        self.created_ns.clear()
        for link in reversed(self.created_links):
            _run(["ip", "link", "del", link], check=False)
        self.created_links.clear()
        shutil.rmtree(self.workdir, ignore_errors=True)

    def _kill_daemons(self) -> None:
        """Kill every process inside this cluster's namespaces: orted daemons detach from mpirun, and the
        ranks they started would outlive them. Only our namespaces are asked, so only our processes die."""
        for ns in self.created_ns:
            pids = _run(["ip", "netns", "pids", ns], check=False).stdout.split()
            for pid in pids:
                with contextlib.suppress(ProcessLookupError, ValueError):
                    os.kill(int(pid), signal.SIGKILL)

    # use -------------------------------------------------------------------------------------
    def describe(self) -> str:
        shaping = self.profile.rate or "unshaped"
        delay = f", +{self.profile.delay_us} us RTT (netem)" if self.netem else (
            ", no added delay (sch_netem missing in this kernel)" if self.profile.delay_us else "")
        cores = (f", node i on core {self.cpus}[i % {len(self.cpus)}]" if self.cpus else ", unpinned")
        ranks = f" x {self.ranks_per_node} ranks" if self.ranks_per_node > 1 else ""
        return f"{self.nodes} nodes{ranks}, {self.profile.name}: {shaping}{delay}, subnet {self.subnet}.0/24{cores}"

    def mpirun(self, argv: list[str], env: dict | None = None, np: int | None = None) -> list[str]:
        """np: the number of nodes to use (default all), each with ranks_per_node ranks."""
        n = np or self.nodes
        k = self.ranks_per_node
        hosts = ",".join(f"{self.ip(i)}:{k}" for i in range(n))
        cmd = ["mpirun", "--allow-run-as-root", "-np", str(n * k), "-H", hosts, "--bind-to", "none",
               "--mca", "plm_rsh_agent", str(self.agent), "--mca", "plm_rsh_no_tree_spawn", "1",
               "--mca", "routed", "direct",
               # Each namespace looks like a 1-slot node, so Open MPI would busy-poll while waiting and
               # steal the shared cores from ranks that compute; yield instead, as on an oversubscribed node.
               "--mca", "mpi_yield_when_idle", "1",
               "--mca", "oob_tcp_if_include", f"{self.subnet}.0/24",
               "--mca", "btl_tcp_if_include", f"{self.subnet}.0/24"]
        if k > 1:  # shared memory inside a node (copying without ptrace, which containers often forbid)
            cmd += ["--mca", "btl", "tcp,self,vader", "--mca", "btl_vader_single_copy_mechanism", "none"]
        else:
            cmd += ["--mca", "btl", "tcp,self"]
        for var in sorted((env or {}).keys() | {"PATH", "PYTHONPATH", "OMP_NUM_THREADS"}):
            cmd += ["-x", var]
        return cmd + argv

    def link_gbps(self) -> float | None:
        """The link between nodes in Gbit/s: the shaped rate, or unshaped the probed bandwidth (once); None with
        one node. What a user tells transport="auto" of their cluster (HVD_TERNGRAD_LINK_GBPS)."""
        if self._link_gbps is None and self.nodes >= 2:
            rate = _rate_gbps(self.profile.rate) if self.profile.rate else None
            self._link_gbps = rate or self.probe()["bandwidth_MBps"] * 8 / 1e3
        return self._link_gbps

    def run(self, argv: list[str], timeout: float = 600, env: dict | None = None, echo=None,
            tag_output: bool = False) -> subprocess.CompletedProcess:
        """Run argv on every node; its output (stdout and stderr together) once it ends. echo: a stream that also
        gets each line as it comes; tag_output: lines tagged `[job,rank]<stdout>:` as horovodrun tags them.
        The job is told the link (HVD_TERNGRAD_LINK_GBPS, for transport="auto") unless env says it."""
        # torch.distributed's rendezvous (DDP methods) at node 0, its traffic over the shaped links
        env = {"MASTER_ADDR": self.ip(0), "GLOO_SOCKET_IFNAME": "eth0", **(env or {})}
        if "HVD_TERNGRAD_LINK_GBPS" not in env and self.link_gbps():
            env["HVD_TERNGRAD_LINK_GBPS"] = f"{self.link_gbps():.3f}"
        full_env = dict(os.environ)
        full_env.update({"PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1",
                         "PATH": f"{Path(sys.executable).parent}{os.pathsep}{full_env.get('PATH', '')}"})
        full_env.update(env or {})
        cmd = self.mpirun(argv, env)
        if tag_output:
            cmd.insert(1, "--tag-output")
        proc = subprocess.Popen(cmd, env=full_env, stdout=subprocess.PIPE,
                                stderr=subprocess.STDOUT, text=True, start_new_session=True, cwd=ROOT)
        self._jobs.append(proc)
        lines: list[str] = []
        reader = threading.Thread(target=_collect, args=(proc.stdout, lines, echo), daemon=True)
        reader.start()
        try:
            proc.wait(timeout=timeout)
            reader.join()
            out = "".join(lines)
        except subprocess.TimeoutExpired:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
            reader.join(timeout=10)
            out = "".join(lines)
            raise TimeoutError(f"job on the emulated cluster exceeded {timeout:.0f} s:\n{out[-3000:]}") from None
        except BaseException:  # Ctrl-C, SIGTERM: never leave mpirun and its daemons behind
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGKILL)
            raise
        finally:
            if proc.poll() is not None and proc in self._jobs:
                self._jobs.remove(proc)
        return subprocess.CompletedProcess(proc.args, proc.returncode, out, "")

    def counters(self) -> list[dict]:
        """Per node: bytes the node sent (host-side rx) and received (host-side tx) since creation."""
        out = []
        for i in range(self.nodes):
            base = Path("/sys/class/net") / self.host_if(i) / "statistics"
            out.append({"node_tx": int((base / "rx_bytes").read_text()),
                        "node_rx": int((base / "tx_bytes").read_text())})
        return out

    def _rtt_ms(self, rounds: int = 200) -> float:
        """Median TCP ping-pong round trip node 1 -> node 0 (ping is not always installed)."""
        server = textwrap.dedent(f"""\
            import socket
            s = socket.socket(); s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            s.bind(("{self.ip(0)}", 5202)); s.listen(1); s.settimeout(30)
            c, _ = s.accept(); c.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            for _ in range({rounds}): c.sendall(c.recv(1))
            """)
        client = textwrap.dedent(f"""\
            import socket, statistics, time
            for _ in range(100):
                try:
                    c = socket.create_connection(("{self.ip(0)}", 5202), timeout=5); break
                except OSError: time.sleep(0.05)
            c.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1); ts = []
            for _ in range({rounds}):
                t = time.perf_counter(); c.sendall(b"x"); c.recv(1); ts.append(time.perf_counter() - t)
            print(statistics.median(ts) * 1e3)
            """)
        srv = subprocess.Popen(["ip", "netns", "exec", self.ns(0), sys.executable, "-c", server])
        out = _run(["ip", "netns", "exec", self.ns(1), sys.executable, "-c", client], timeout=60).stdout
        srv.wait(timeout=30)
        return float(out.strip())

    def probe(self, seconds: float = 2.0) -> dict:
        """Measured TCP bandwidth node 1 -> node 0 and ping RTT, for labeling profiles."""
        if self.nodes < 2:
            raise ValueError("probe needs 2 nodes")
        server = textwrap.dedent(f"""\
            import socket, time
            s = socket.socket(); s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            s.bind(("{self.ip(0)}", 5201)); s.listen(1); s.settimeout(30)
            c, _ = s.accept(); c.settimeout(30); n = 0; t0 = None
            while True:
                b = c.recv(1 << 20)
                if not b: break
                t0 = t0 or time.perf_counter(); n += len(b)
            print(n / (time.perf_counter() - t0))
            """)
        client = textwrap.dedent(f"""\
            import socket, time
            for _ in range(100):
                try:
                    c = socket.create_connection(("{self.ip(0)}", 5201), timeout=5); break
                except OSError: time.sleep(0.05)
            buf = b"x" * (1 << 20); t_end = time.perf_counter() + {seconds}
            while time.perf_counter() < t_end: c.sendall(buf)
            c.close()
            """)
        srv = subprocess.Popen(["ip", "netns", "exec", self.ns(0), sys.executable, "-c", server],
                               stdout=subprocess.PIPE, text=True)
        _run(["ip", "netns", "exec", self.ns(1), sys.executable, "-c", client], timeout=seconds + 30)
        bw = float(srv.communicate(timeout=30)[0].strip())
        rtt = self._rtt_ms()
        return {"profile": self.profile.name, "bandwidth_MBps": bw / 1e6, "rtt_ms": rtt, "netem": self.netem}


def _rate_gbps(rate: str) -> float | None:
    """A tc rate ("1gbit", "500mbit", "100kbit") in Gbit/s; None if it reads otherwise."""
    units = {"kbit": 1e-6, "mbit": 1e-3, "gbit": 1.0}
    for unit, scale in units.items():
        if rate.lower().endswith(unit):
            try:
                return float(rate[: -len(unit)]) * scale
            except ValueError:
                return None
    return None


def resolve_profile(name: str | None, rate: str | None, delay_us: int) -> Profile:
    if rate or name == "custom":
        if not rate:
            raise SystemExit("cluster: --profile custom needs --rate (e.g. 500mbit)")
        return Profile("custom", rate, delay_us)
    if name not in PROFILES:
        raise SystemExit(f"cluster: unknown profile {name!r}; allowed: {', '.join(PROFILES)}, custom")
    return PROFILES[name]


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = ap.add_subparsers(dest="cmd", required=True)
    sub.add_parser("check", help="exit 0 where this machine can emulate a cluster, else 2 and why not")
    for name in ("run", "probe"):
        p = sub.add_parser(name)
        p.add_argument("--nodes", type=int, default=2)
        p.add_argument("--profile", default="ethernet-1g")
        p.add_argument("--rate", help="custom tc rate, e.g. 500mbit")
        p.add_argument("--delay-us", type=int, default=0, help="custom round-trip delay (needs sch_netem)")
        p.add_argument("--timeout", type=float, default=600)
        p.add_argument("--no-pin", action="store_true", help="let the ranks float over the cores")
        p.add_argument("--ranks-per-node", type=int, default=1, help="ranks on every node, sharing its link")
        if name == "run":
            p.add_argument("--stream", action="store_true", help="print the job's lines as they come")
            p.add_argument("--tag-output", action="store_true", help="tag lines [job,rank]<stdout>: as horovodrun")
            p.add_argument("argv", nargs=argparse.REMAINDER, help="-- command to run on every node")
    args = ap.parse_args(argv)
    if args.cmd == "check":
        try:
            check_support()
        except ClusterUnavailable as exc:
            print(f"cluster: cannot emulate a cluster here: {exc}", file=sys.stderr)
            return 2
        return 0
    profile = resolve_profile(args.profile, args.rate, args.delay_us)
    try:
        with EmulatedCluster(args.nodes, profile, pin=not args.no_pin, ranks_per_node=args.ranks_per_node) as c:
            print(f"cluster: {c.describe()}", flush=True)
            if args.cmd == "probe":
                print(json.dumps(c.probe()))
                return 0
            cmd = args.argv[1:] if args.argv[:1] == ["--"] else args.argv
            if not cmd:
                raise SystemExit("cluster run: give the command after --")
            before = c.counters()
            res = c.run(cmd, timeout=args.timeout, echo=sys.stdout if args.stream else None,
                        tag_output=args.tag_output)
            after = c.counters()
            if not args.stream:
                print(res.stdout, end="")
            for i, (b, a) in enumerate(zip(before, after)):
                print(f"cluster: node {i} sent {a['node_tx'] - b['node_tx']:,} B, "
                      f"received {a['node_rx'] - b['node_rx']:,} B")
            return res.returncode
    except ClusterUnavailable as exc:
        print(f"cluster: cannot emulate a cluster here: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
