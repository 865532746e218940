"""NIXL's host-memory transfer over UCX on loopback, shaped like ``kvd-bench transfer``
(benches/src/transfer.rs), so that the two can be set side by side (scripts/bench-nixl.sh).

Two processes: this one (the initiator) and a target it starts as a child (this file with
``--role target``). Each side mmaps one page-aligned host buffer of 2 x BATCH x the largest block
(1 GiB for 4 MiB blocks), touches every page and registers it with NIXL's UCX backend
(``register_memory``). The target sends its agent metadata (``get_agent_metadata``) and buffer
address over a loopback control socket; the initiator loads it (``add_remote_agent``), connects
(``make_connection``), prepares one local and one remote descriptor list of 2 x BATCH blocks per
block size (``prep_xfer_dlist``) and makes one transfer request per half
(``make_prepped_xfer``). The halves are the same memory on both sides, at the same offsets:
with ``--layout contiguous`` (the default, kvd-bench's layout) half h is slots h*BATCH ..
h*BATCH+BATCH-1, so a request's blocks are adjacent and NIXL merges them into one descriptor
(``--telemetry`` shows desc_count 1); with ``--layout scattered`` the halves interleave (slot
2*i+h) and each block stays a descriptor of its own. A case keeps two requests in flight
(``--inflight``), alternating between the halves and re-posting each request when it completes
(``transfer``, then polling ``check_xfer_state``), until at least ``--gib-per-case`` GiB moved;
it fails after ``--case-timeout`` seconds. WRITE pushes the initiator's blocks into the
target's, READ pulls the target's into the initiator's.

The target's agent has NIXL's progress thread (its main thread only answers the control
socket); the initiator's has none by default (``--prog-thread off``): the Python API starts
that thread with no delay, so it spins, and on two cores a spinning thread beside the polling
main thread and the target's own halves the rate. The initiator's post and polls drive UCX.

GB/s is bytes moved / seconds from the first post to the last completion (GB = 1e9 bytes, as in
kvd-bench). CPU s/GB is user + system time of both processes over the case. A stamp in every
block is checked after each case (on the target after a write, here after a read), so a case
that moved nothing cannot pass. One untimed pass over both halves precedes each case.

Prints one line per case, ``nixl write 1024 KiB: 5.12 GB/s``, on stdout (details on stderr);
``--json PATH`` writes all results. Environment defaults (each kept if already set):
UCX_TLS=tcp,self (host memory over TCP, no shared memory, no GPU); UCX_NET_DEVICES=lo (only
127.0.0.1: with all devices UCX also opens a lane over the machine's own eth0 address and
splits each put across the two); UCX_MODULES=^ib,cuda (the wheel's InfiniBand module pulls in
a libnl whose destructor crashes at process exit on a machine without IB devices).
"""
from __future__ import annotations

import argparse
import json
import mmap
import os
import resource
import socket
import struct
import subprocess
import sys
import time

os.environ.setdefault("UCX_TLS", "tcp,self")
os.environ.setdefault("UCX_MODULES", "^ib,cuda")
os.environ.setdefault("UCX_NET_DEVICES", "lo")
os.environ.setdefault("NIXL_LOG_LEVEL", "WARN")

import numpy as np  # noqa: E402

try:  # the wheel nixl-cu12 installs the package nixl_cu12; the meta package nixl, nixl
    from nixl_cu12 import nixl_agent, nixl_agent_config  # noqa: E402

    NIXL_DIST = "nixl-cu12"
except ImportError:  # pragma: no cover
    from nixl import nixl_agent, nixl_agent_config  # type: ignore  # noqa: E402

    NIXL_DIST = "nixl"

GB = 1e9
MIB = 1 << 20
# every wait for the other process (connect, a control reply) is bounded by this
CONTROL_TIMEOUT_S = 60.0
# a target answers at most this many control messages, then gives up
MAX_CONTROL_MESSAGES = 100_000


def log(msg: str) -> None:
    print(f"nixl_transfer: {msg}", file=sys.stderr, flush=True)


def cpu_seconds() -> float:
    u = resource.getrusage(resource.RUSAGE_SELF)
    return u.ru_utime + u.ru_stime


# --- control channel: length-prefixed frames over a loopback TCP socket ---------------------


def send_frame(s: socket.socket, payload: bytes) -> None:
    s.sendall(struct.pack(">I", len(payload)) + payload)


def recv_exact(s: socket.socket, n: int) -> bytes:
    buf = bytearray()
    while len(buf) < n:
        chunk = s.recv(n - len(buf))
        if not chunk:
            raise ConnectionError("the control connection closed")
        buf += chunk
    return bytes(buf)


def recv_frame(s: socket.socket) -> bytes:
    (n,) = struct.unpack(">I", recv_exact(s, 4))
    if n > 64 * MIB:
        raise ConnectionError(f"control frame of {n} bytes")
    return recv_exact(s, n)


def send_json(s: socket.socket, obj) -> None:
    send_frame(s, json.dumps(obj).encode())


def recv_json(s: socket.socket):
    return json.loads(recv_frame(s))


# --- memory -----------------------------------------------------------------------------------


class Buffer:
    """One page-aligned anonymous mapping, every page touched, viewed as bytes."""

    def __init__(self, size: int):
        self.size = size
        self.map = mmap.mmap(-1, size, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
        self.bytes = np.frombuffer(self.map, dtype=np.uint8)
        self.addr = self.bytes.ctypes.data
        if self.addr % mmap.PAGESIZE:
            raise RuntimeError("mmap returned an unaligned buffer")
        self.bytes.fill(0x5A)  # fault every page in before registration and timing
        self.words = self.bytes.view(np.uint64)

    def stamp(self, offsets: list[int], value: int) -> None:
        self.words[np.asarray(offsets, dtype=np.int64) // 8] = value

    def stamps_ok(self, offsets: list[int], value: int) -> bool:
        return bool(np.all(self.words[np.asarray(offsets, dtype=np.int64) // 8] == value))

    def close(self) -> None:
        del self.words, self.bytes
        self.map.close()


def block_offsets(block: int, batch: int, layout: str) -> list[int]:
    """Offsets of the 2 x batch blocks, half 0's then half 1's. contiguous (kvd-bench's layout):
    half h's block i at slot h * batch + i, so a request's blocks are adjacent and NIXL may merge
    them into one descriptor; scattered: at slot 2 * i + h, the halves interleaved, so no two
    blocks of a request touch and each stays a transfer of its own. The same memory either way.
    """
    if layout == "contiguous":
        slots = range(2 * batch)
    else:
        slots = [2 * i + h for h in range(2) for i in range(batch)]
    return [k * block for k in slots]


def make_agent(name: str, prog_thread: bool, telemetry: bool, params: dict[str, str]):
    """An agent with the UCX backend, created with `params` (its init parameters; the plugin's
    defaults where empty: ucx_error_handling_mode=peer, num_workers=1, ucx_devices='')."""
    cfg = nixl_agent_config(
        enable_prog_thread=prog_thread, backends=[], capture_telemetry=telemetry
    )
    agent = nixl_agent(name, cfg)
    if "UCX" not in agent.get_plugin_list():
        raise RuntimeError(f"NIXL has no UCX plugin here (plugins: {agent.get_plugin_list()})")
    agent.create_backend("UCX", params)
    return agent


def ucx_params(pairs: list[str]) -> dict[str, str]:
    out = {}
    for kv in pairs:
        k, sep, v = kv.partition("=")
        if not sep or not k:
            raise SystemExit(f"--ucx-param takes KEY=VALUE, not {kv!r}")
        out[k] = v
    return out


# --- target -----------------------------------------------------------------------------------


def run_target(args) -> int:
    ctl = socket.create_connection(tuple_addr(args.control), timeout=CONTROL_TIMEOUT_S)
    ctl.settimeout(args.target_idle_timeout)
    buf = Buffer(args.bytes)
    agent = make_agent(args.name, True, False, json.loads(args.params))
    reg = agent.register_memory([(buf.addr, buf.size, 0, "")], "DRAM")
    send_json(ctl, {"name": args.name, "addr": buf.addr, "size": buf.size, "pid": os.getpid()})
    send_frame(ctl, agent.get_agent_metadata())
    try:
        for _ in range(MAX_CONTROL_MESSAGES):
            msg = recv_json(ctl)
            op = msg["op"]
            if op == "cpu":
                send_json(ctl, {"cpu": cpu_seconds()})
            elif op == "stamp":
                buf.stamp(msg["offsets"], msg["value"])
                send_json(ctl, {"ok": True})
            elif op == "check":
                send_json(ctl, {"ok": buf.stamps_ok(msg["offsets"], msg["value"])})
            elif op == "bye":
                break
            else:
                send_json(ctl, {"error": f"unknown op {op!r}"})
    finally:
        agent.deregister_memory(reg)
        ctl.close()
    return 0


def tuple_addr(s: str) -> tuple[str, int]:
    host, port = s.rsplit(":", 1)
    return host, int(port)


# --- initiator --------------------------------------------------------------------------------


class Target:
    """The target child process and its control connection."""

    def __init__(self, size: int, params: dict[str, str]):
        lsn = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        lsn.bind(("127.0.0.1", 0))
        lsn.listen(1)
        lsn.settimeout(CONTROL_TIMEOUT_S)
        port = lsn.getsockname()[1]
        self.name = f"kvd-nixl-target-{os.getpid()}"
        self.proc = subprocess.Popen(
            [
                sys.executable,
                os.path.abspath(__file__),
                "--role",
                "target",
                "--control",
                f"127.0.0.1:{port}",
                "--bytes",
                str(size),
                "--name",
                self.name,
                "--params",
                json.dumps(params),
            ],
            stdin=subprocess.DEVNULL,
        )
        try:
            self.ctl, _ = lsn.accept()
        except socket.timeout:
            self.proc.kill()
            raise RuntimeError(f"the target did not connect within {CONTROL_TIMEOUT_S:.0f} s")
        finally:
            lsn.close()
        self.ctl.settimeout(CONTROL_TIMEOUT_S)
        self.info = recv_json(self.ctl)
        self.metadata = recv_frame(self.ctl)
        self.pid = self.info["pid"]

    def call(self, op: str, **kw):
        send_json(self.ctl, {"op": op, **kw})
        reply = recv_json(self.ctl)
        if "error" in reply:
            raise RuntimeError(f"target: {reply['error']}")
        return reply

    def close(self) -> None:
        try:
            send_json(self.ctl, {"op": "bye"})
        except OSError:
            pass
        try:
            rc = self.proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            log("the target did not exit within 30 s; killing it")
            self.proc.kill()
            rc = self.proc.wait(timeout=30)
        self.ctl.close()
        if rc != 0:
            log(f"the target exited with status {rc}")


def wait_done(agent, handle, deadline: float, what: str) -> None:
    """Poll check_xfer_state until DONE; bounded by `deadline` (time.monotonic())."""
    polls = 0
    while True:
        state = agent.check_xfer_state(handle)
        if state == "DONE":
            return
        if state == "ERR":
            raise RuntimeError(f"{what}: the transfer failed (check_xfer_state ERR)")
        polls += 1
        if polls % 1024 == 0 and time.monotonic() > deadline:
            raise RuntimeError(f"{what}: a transfer request did not complete in time")


def run_case(agent, target: Target, local: Buffer, dl_local, dl_remote, op: str, block: int,
             args, stamp_value: int, total: int) -> dict:
    batch = args.batch
    half = batch * block
    what = f"nixl {op.lower()} {block // 1024} KiB"
    offsets = block_offsets(block, batch, args.layout)
    # the data a case must move: a stamp in every block of the source side
    if op == "WRITE":
        local.stamp(offsets, stamp_value)
    else:
        target.call("stamp", offsets=offsets, value=stamp_value)
    halves = [np.arange(h * batch, (h + 1) * batch, dtype=np.int32) for h in range(2)]
    handles = [agent.make_prepped_xfer(op, dl_local, idx, dl_remote, idx) for idx in halves]
    # the most requests a case can post, whatever the clock says
    max_requests = -(-total // half) + args.inflight
    cpu0 = cpu_seconds() + target.call("cpu")["cpu"]
    latencies = []
    in_flight: list[tuple[int, float]] = []  # (half, post time)
    moved, posted, nxt = 0, 0, 0
    t0 = time.monotonic()
    deadline = t0 + args.case_timeout

    def post(h: int) -> None:
        nonlocal posted
        t_post = time.monotonic()  # before the call: without a progress thread, it moves data
        state = agent.transfer(handles[h])
        if state == "ERR":
            raise RuntimeError(f"{what}: posting a transfer request failed")
        in_flight.append((h, t_post))
        posted += 1

    telemetry = {}
    done_halves: set[int] = set()

    def finish() -> None:
        nonlocal moved
        h, t_post = in_flight.pop(0)
        wait_done(agent, handles[h], deadline, what)
        latencies.append(time.monotonic() - t_post)
        moved += half
        done_halves.add(h)
        if args.telemetry and not telemetry:
            t = agent.get_xfer_telemetry(handles[h])
            telemetry.update(desc_count=t.descCount, total_bytes=t.totalBytes,
                             post_us=t.postDuration, xfer_us=t.xferDuration)

    try:
        while moved < total:
            if time.monotonic() > deadline:
                raise RuntimeError(
                    f"{what}: moved {moved / (1 << 30):.2f} of {total / (1 << 30):.2f} GiB in "
                    f"{args.case_timeout:.0f} s; giving up"
                )
            while len(in_flight) < args.inflight and moved + len(in_flight) * half < total:
                if posted >= max_requests:
                    raise RuntimeError(f"{what}: posted {posted} requests, more than planned")
                post(nxt % 2)
                nxt += 1
            finish()
        while in_flight:
            finish()
        secs = time.monotonic() - t0
    finally:
        # an error can leave requests posted: give them until the deadline, then release
        try:
            while in_flight:
                finish()
        except Exception:  # noqa: BLE001
            in_flight.clear()
        for h in handles:
            try:
                h.release()
            except Exception as e:  # noqa: BLE001
                log(f"releasing a transfer handle: {e}")
    cpu = cpu_seconds() + target.call("cpu")["cpu"] - cpu0
    # the blocks of every half that completed at least once must hold this case's stamp
    moved_offsets = [o for h in sorted(done_halves) for o in offsets[h * batch:(h + 1) * batch]]
    if op == "WRITE":
        ok = target.call("check", offsets=moved_offsets, value=stamp_value)["ok"]
    else:
        ok = local.stamps_ok(moved_offsets, stamp_value)
    if not ok:
        raise RuntimeError(f"{what}: the destination blocks do not hold the data sent")
    lat = sorted(latencies)
    return {
        "direction": op.lower(),
        "block_kib": block // 1024,
        "batch": batch,
        "inflight": args.inflight,
        "requests": len(latencies),
        "bytes": moved,
        "seconds": secs,
        "gbps": moved / secs / GB,
        "cpu_s_per_gb": cpu / (moved / GB),
        "request_ms_p50": lat[len(lat) // 2] * 1e3,
        "request_ms_max": lat[-1] * 1e3,
        "layout": args.layout,
        **({"telemetry": telemetry} if telemetry else {}),
    }


def run_initiator(args) -> int:
    blocks = [int(k) * 1024 for k in args.block_kib.split(",") if k]
    dirs = [d.strip().upper() for d in args.direction.split(",") if d.strip()]
    if not blocks or any(b <= 0 for b in blocks) or args.batch <= 0 or args.inflight not in (1, 2):
        raise SystemExit("--block-kib needs positive sizes, --batch > 0, --inflight 1 or 2")
    if any(d not in ("WRITE", "READ") for d in dirs) or not dirs:
        raise SystemExit("--direction takes write and/or read")
    if args.gib_per_case <= 0 or args.case_timeout <= 0:
        raise SystemExit("--gib-per-case and --case-timeout must be positive")
    size = 2 * args.batch * max(blocks)
    log(f"{NIXL_DIST} {dist_version()}, UCX_TLS={os.environ['UCX_TLS']}; "
        f"{size // MIB} MiB buffer on each side; starting the target")
    target = Target(size, ucx_params(args.ucx_param))
    try:
        results = measure(args, target, blocks, dirs, size)
    finally:
        target.close()
    write_json(args, results)
    return 0


def measure(args, target: Target, blocks: list[int], dirs: list[str], size: int) -> list[dict]:
    results: list[dict] = []
    local = Buffer(size)
    agent = make_agent(f"kvd-nixl-initiator-{os.getpid()}", args.prog_thread == "on",
                       args.telemetry, ucx_params(args.ucx_param))
    reg = agent.register_memory([(local.addr, local.size, 0, "")], "DRAM")
    try:
        remote_name = agent.add_remote_agent(target.metadata)
        if isinstance(remote_name, bytes):  # the binding returns the name as bytes
            remote_name = remote_name.decode()
        if remote_name != target.name:
            raise RuntimeError(f"loaded metadata of {remote_name!r}, not {target.name!r}")
        agent.make_connection(remote_name)
        stamp = 1
        for block in blocks:
            offs = block_offsets(block, args.batch, args.layout)
            local_descs = np.array([(local.addr + o, block, 0) for o in offs], dtype=np.uint64)
            remote_descs = np.array(
                [(target.info["addr"] + o, block, 0) for o in offs], dtype=np.uint64
            )
            dl_local = agent.prep_xfer_dlist("NIXL_INIT_AGENT", local_descs, "DRAM")
            dl_remote = agent.prep_xfer_dlist(remote_name, remote_descs, "DRAM")
            try:
                for op in dirs:
                    case = (agent, target, local, dl_local, dl_remote, op, block, args)
                    for _ in range(args.warmup):  # one request per half, not timed
                        stamp += 1
                        run_case(*case, stamp, 2 * args.batch * block)
                    stamp += 1
                    r = run_case(*case, stamp, int(args.gib_per_case * (1 << 30)))
                    results.append(r)
                    print(f"nixl {r['direction']} {r['block_kib']} KiB: {r['gbps']:.2f} GB/s",
                          flush=True)
                    log(f"  {r['requests']} requests of {args.batch} x {r['block_kib']} KiB, "
                        f"{r['bytes'] / (1 << 30):.2f} GiB in {r['seconds']:.2f} s, "
                        f"{r['cpu_s_per_gb']:.3f} CPU s/GB, request p50 "
                        f"{r['request_ms_p50']:.1f} ms, max {r['request_ms_max']:.1f} ms")
            finally:
                dl_local.release()
                dl_remote.release()
        agent.remove_remote_agent(remote_name)
    finally:
        agent.deregister_memory(reg)
    return results


def write_json(args, results: list[dict]) -> None:
    if args.json:
        doc = {
            "tool": "nixl_transfer.py",
            "nixl": {"dist": NIXL_DIST, "version": dist_version()},
            "env": {k: v for k, v in os.environ.items() if k.startswith(("UCX_", "NIXL_"))},
            "batch": args.batch,
            "inflight": args.inflight,
            "gib_per_case": args.gib_per_case,
            "initiator_prog_thread": args.prog_thread,
            "layout": args.layout,
            "ucx_params": ucx_params(args.ucx_param),
            "cases": results,
        }
        with open(args.json, "w") as f:
            json.dump(doc, f, indent=2)
            f.write("\n")


def dist_version() -> str:
    try:
        from importlib.metadata import version

        return version(NIXL_DIST)
    except Exception:  # noqa: BLE001
        return "unknown"


def main() -> int:
    p = argparse.ArgumentParser(
        description="NIXL host-memory transfer (WRITE and READ over UCX, loopback), shaped like "
        "kvd-bench transfer: 128-block requests, two halves alternating, two in flight."
    )
    p.add_argument("--block-kib", default="1024,4096", help="block sizes in KiB, comma-separated")
    p.add_argument("--direction", default="write,read", help="write and/or read, comma-separated")
    p.add_argument("--batch", type=int, default=128, help="blocks per transfer request")
    p.add_argument("--inflight", type=int, default=2, help="requests in flight (1 or 2)")
    p.add_argument("--gib-per-case", type=float, default=1.0, help="GiB moved per case, at least")
    p.add_argument("--case-timeout", type=float, default=60.0, help="seconds a case may take")
    p.add_argument("--warmup", type=int, default=1,
                   help="untimed passes over both halves before each case")
    p.add_argument("--layout", choices=("contiguous", "scattered"), default="contiguous",
                   help="where a request's blocks lie (see block_offsets)")
    p.add_argument("--telemetry", action="store_true",
                   help="capture NIXL telemetry and report each case's descriptor count")
    p.add_argument("--prog-thread", choices=("on", "off"), default="off",
                   help="the initiator agent's progress thread (the target always has one)")
    p.add_argument("--ucx-param", action="append", default=[], metavar="KEY=VALUE",
                   help="a UCX backend init parameter for both agents (num_workers=2, ...)")
    p.add_argument("--json", help="write the results here")
    # the target child's arguments
    p.add_argument("--role", choices=("initiator", "target"), default="initiator",
                   help=argparse.SUPPRESS)
    p.add_argument("--control", help=argparse.SUPPRESS)
    p.add_argument("--bytes", type=int, help=argparse.SUPPRESS)
    p.add_argument("--name", help=argparse.SUPPRESS)
    p.add_argument("--params", default="{}", help=argparse.SUPPRESS)
    p.add_argument("--target-idle-timeout", type=float, default=600.0, help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.role == "target":
        return run_target(args)
    return run_initiator(args)


if __name__ == "__main__":
    try:
        rc = main()
    except SystemExit as e:
        rc = e.code if isinstance(e.code, int) else (print(e.code, file=sys.stderr) or 2)
    except Exception as e:  # noqa: BLE001
        print(f"nixl_transfer: error: {e}", file=sys.stderr)
        rc = 1
    sys.stdout.flush()
    sys.stderr.flush()
    # skip the interpreter's teardown: the wheel's native libraries have crashed in their
    # destructors at exit; everything above has already been released explicitly
    os._exit(rc)
