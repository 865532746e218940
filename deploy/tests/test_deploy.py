"""The deployment files, checked by the tools operators use, and against a real daemon.

- Kubernetes: every kustomization renders (`kubectl kustomize`) and validates against the schemas
  of a pinned Kubernetes version (`kubernetes-validate`, which ships them: no cluster); the
  DaemonSet's timings and memory match the daemon's own; the config its init container renders
  is one `kvd serve --check-config` accepts.
- systemd: `systemd-analyze verify` accepts the unit (skipped, saying so, without systemd).
- Prometheus: `promtool check rules` and `promtool test rules`; every expression of the rules
  and of the Grafana dashboard parses (as recording rules, through promtool).
- Every metric the dashboard and the rules name is exported by a real daemon in cluster mode
  (a real etcd on loopback, two nodes), scraped after a put, a push, a checkpoint and during a
  drain.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

import pytest
import yaml

ROOT = Path(__file__).resolve().parents[2]
DEPLOY = ROOT / "deploy"
KUBE = DEPLOY / "kubernetes"
KUBERNETES_VERSION = "1.30.0"
KVD = os.environ.get("KVD_BIN") or str(ROOT / "target" / "debug" / "kvd")
DAEMON_OVERHEAD_MIB = 256

sys.path.insert(0, str(ROOT / "ffi" / "python" / "tests"))
from conftest import Daemon, wait_until  # noqa: E402  (the package tests' real-daemon harness)


def run(*cmd: str, **kw) -> subprocess.CompletedProcess:
    return subprocess.run(list(cmd), capture_output=True, text=True, timeout=120, **kw)


def kustomizations() -> list[Path]:
    return sorted(p.parent for p in KUBE.rglob("kustomization.yaml"))


def render(k: Path) -> list[dict]:
    r = run("kubectl", "kustomize", str(k))
    assert r.returncode == 0, f"kubectl kustomize {k}: {r.stderr}"
    return [d for d in yaml.safe_load_all(r.stdout) if d]


def find(docs: list[dict], kind: str, name: str) -> dict:
    return next(d for d in docs if d["kind"] == kind and d["metadata"]["name"] == name)


# -- Kubernetes -----------------------------------------------------------------------------


@pytest.mark.parametrize("k", kustomizations(), ids=lambda p: str(p.relative_to(KUBE)))
def test_each_kustomization_renders_and_validates_against_the_pinned_kubernetes_schemas(k, tmp_path):
    out = tmp_path / "rendered.yaml"
    out.write_text(yaml.safe_dump_all(render(k)))
    r = run("kubernetes-validate", "--strict", "-k", KUBERNETES_VERSION, str(out))
    assert r.returncode == 0, r.stdout + r.stderr


def test_the_examples_validate_against_the_pinned_kubernetes_schemas():
    for f in sorted((KUBE / "examples").glob("*.yaml")):
        r = run("kubernetes-validate", "--strict", "-k", KUBERNETES_VERSION, str(f))
        assert r.returncode == 0, r.stdout + r.stderr


def kvd_container(ds: dict) -> dict:
    return next(c for c in ds["spec"]["template"]["spec"]["containers"] if c["name"] == "kvd")


def mib(quantity: str) -> int:
    units = {"Mi": 1, "Gi": 1024}
    m = re.fullmatch(r"(\d+)(Mi|Gi)", quantity)
    assert m, f"memory {quantity!r} is not in Mi or Gi"
    return int(m.group(1)) * units[m.group(2)]


@pytest.mark.parametrize("k", kustomizations(), ids=lambda p: str(p.relative_to(KUBE)))
def test_the_daemonsets_memory_covers_its_pool_and_its_timings_cover_the_drain(k, tmp_path):
    docs = render(k)
    ds, c = find(docs, "DaemonSet", "kvd"), None
    c = kvd_container(ds)
    args = c["args"]
    pool_mib = int(args[args.index("--pool-mib") + 1])
    for side in ("requests", "limits"):
        assert mib(c["resources"][side]["memory"]) >= pool_mib + DAEMON_OVERHEAD_MIB, (k, side)
    config = resolved_config(docs, tmp_path)
    grace = ds["spec"]["template"]["spec"]["terminationGracePeriodSeconds"]
    assert grace >= config["hard_deadline_ms"] / 1000 + 5, "the grace period must outlast the watchdog"
    pre = c["lifecycle"]["preStop"]["exec"]["command"]
    assert pre[1] == "drain" and int(pre[pre.index("--wait-secs") + 1]) < grace
    assert c["livenessProbe"]["httpGet"]["path"] == "/healthz"
    assert c["readinessProbe"]["httpGet"]["path"] == "/readyz"
    assert c["startupProbe"]["httpGet"]["path"] == "/healthz"
    ports = {p["name"]: p["containerPort"] for p in c["ports"]}
    assert ports["admin"] == int(config["admin_listen"].rsplit(":", 1)[1])
    # The probes use the daemon's probe listener, which answers under an admin flood.
    assert ports["probes"] == int(config["probe_listen"].rsplit(":", 1)[1])
    for probe in ("livenessProbe", "readinessProbe", "startupProbe"):
        assert c[probe]["httpGet"]["port"] == "probes", probe
    mounts = {m["mountPath"] for m in c["volumeMounts"]}
    assert os.path.dirname(config["socket"]) in mounts and config["data_dir"] in mounts


def resolved_config(docs: list[dict], tmp: Path, host_ip: str = "10.1.2.3") -> dict:
    """Run the init container's script on the ConfigMap's template, then `kvd serve
    --check-config` on the result with the container's own arguments."""
    ds = find(docs, "DaemonSet", "kvd")
    init = ds["spec"]["template"]["spec"]["initContainers"][0]
    template = find(docs, "ConfigMap", "kvd-config")["data"]["kvd.toml.in"]
    endpoints = find(docs, "ConfigMap", "kvd-cluster")["data"]["etcd-endpoints"]
    (tmp / "template").mkdir(exist_ok=True)
    (tmp / "rendered").mkdir(exist_ok=True)
    (tmp / "template" / "kvd.toml.in").write_text(template)
    script = init["command"][2].replace("/etc/kvd/template", str(tmp / "template")).replace(
        "/etc/kvd/rendered", str(tmp / "rendered"))
    r = run("sh", "-ec", script, env={"PATH": os.environ["PATH"], "HOST_IP": host_ip, "ETCD_ENDPOINTS": endpoints})
    assert r.returncode == 0, r.stderr
    args = kvd_container(ds)["args"]
    assert args[:3] == ["serve", "--config", "/etc/kvd/rendered/kvd.toml"]
    r = run(KVD, "serve", "--config", str(tmp / "rendered" / "kvd.toml"), *args[3:], "--check-config")
    assert r.returncode == 0, f"kvd refused the rendered config: {r.stderr}"
    return json.loads(r.stdout)


def test_the_init_container_gives_each_node_its_address_as_id_and_the_clusters_etcd(tmp_path):
    docs = render(KUBE / "overlays" / "example-gpu-node")
    config = resolved_config(docs, tmp_path, "10.1.2.3")
    text = json.dumps(config)
    assert config["node_id"] == ((10 * 256 + 1) * 256 + 2) * 256 + 3
    assert "10.1.2.3:7461" in text, "the data port on the node's own address"
    for e in find(docs, "ConfigMap", "kvd-cluster")["data"]["etcd-endpoints"].split(","):
        assert e in text
    other = resolved_config(docs, tmp_path, "10.1.2.4")
    assert other["node_id"] != config["node_id"]


# -- systemd --------------------------------------------------------------------------------


def test_systemd_analyze_accepts_the_unit(tmp_path):
    if shutil.which("systemd-analyze") is None:
        pytest.skip("no systemd-analyze on this machine: the unit was not verified")
    unit = (DEPLOY / "systemd" / "kvd.service").read_text()
    # The unit names the installed binary; verify it against the one built here.
    unit = unit.replace("/usr/local/bin/kvd", str(Path(KVD).resolve()))
    (tmp_path / "kvd.service").write_text(unit)
    r = run("systemd-analyze", "verify", str(tmp_path / "kvd.service"))
    problems = [line for line in (r.stdout + r.stderr).splitlines()
                if "kvd.service" in line and "Failed to" not in line.split("kvd.service")[0]]
    assert r.returncode == 0 and not problems, r.stdout + r.stderr


def test_the_systemd_example_config_is_one_kvd_accepts():
    r = run(KVD, "serve", "--config", str(DEPLOY / "systemd" / "kvd.toml"), "--check-config")
    assert r.returncode == 0, r.stderr


# -- Prometheus and Grafana -----------------------------------------------------------------


def test_promtool_checks_the_rules_and_their_unit_tests_pass():
    rules = DEPLOY / "prometheus"
    r = run("promtool", "check", "rules", str(rules / "kvd-alerts.yaml"))
    assert r.returncode == 0, r.stdout + r.stderr
    r = run("promtool", "test", "rules", str(rules / "kvd-alerts.test.yaml"))
    assert r.returncode == 0, r.stdout + r.stderr


def dashboard_exprs() -> list[str]:
    d = json.loads((DEPLOY / "grafana" / "kvd-dashboard.json").read_text())
    # The node variable's label_values(METRIC, LABEL), as the query Grafana sends for it.
    metric, label = re.fullmatch(r"label_values\((\w+), (\w+)\)", d["templating"]["list"][1]["definition"]).groups()
    out = [f"group by ({label}) ({metric})"]
    for p in d["panels"]:
        for t in p.get("targets", []):
            out.append(t["expr"])
    return out


def alert_exprs() -> list[str]:
    rules = yaml.safe_load((DEPLOY / "prometheus" / "kvd-alerts.yaml").read_text())
    return [r["expr"] for g in rules["groups"] for r in g["rules"]]


def test_every_dashboard_and_alert_expression_parses(tmp_path):
    exprs = dashboard_exprs() + alert_exprs()
    # Grafana's variables, as Grafana substitutes them.
    subst = [e.replace("$__rate_interval", "5m").replace("$node", ".*") for e in exprs]
    rules = {"groups": [{"name": "parse", "rules": [{"record": f"kvd:parse:{i}", "expr": e} for i, e in enumerate(subst)]}]}
    f = tmp_path / "parse.yaml"
    f.write_text(yaml.safe_dump(rules))
    r = run("promtool", "check", "rules", str(f))
    assert r.returncode == 0, r.stdout + r.stderr
    assert len(exprs) > 30


def test_the_dashboard_opens_with_its_overview_row_and_a_node_variable():
    d = json.loads((DEPLOY / "grafana" / "kvd-dashboard.json").read_text())
    assert d["panels"][0]["type"] == "row" and d["panels"][0]["title"] == "Overview"
    names = [v["name"] for v in d["templating"]["list"]]
    assert names == ["datasource", "node"]
    ids = [p["id"] for p in d["panels"]]
    assert len(ids) == len(set(ids)), "panel ids are unique"


# -- the metrics they name, from a real daemon ----------------------------------------------


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture
def etcd(tmp_path):
    binary = shutil.which("etcd")
    assert binary, "etcd is not installed (scripts/test.sh installs etcd-server)"
    client, peer = free_port(), free_port()
    url = f"http://127.0.0.1:{client}"
    p = subprocess.Popen(
        [binary, "--name", "deploy-test", "--data-dir", str(tmp_path / "etcd"),
         "--listen-client-urls", url, "--advertise-client-urls", url,
         "--listen-peer-urls", f"http://127.0.0.1:{peer}",
         "--initial-advertise-peer-urls", f"http://127.0.0.1:{peer}",
         "--initial-cluster", f"deploy-test=http://127.0.0.1:{peer}"],
        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        def up() -> bool:
            try:
                urllib.request.urlopen(f"{url}/health", timeout=1).read()
                return True
            except OSError:
                return False
        wait_until("etcd answers", up, 30)
        yield url
    finally:
        p.kill()
        p.wait(timeout=30)


def scrape(admin: str) -> dict[str, float]:
    text = urllib.request.urlopen(f"http://{admin}/metrics", timeout=5).read().decode()
    out: dict[str, float] = {}
    for line in text.splitlines():
        if line and not line.startswith("#"):
            name = re.split(r"[{ ]", line, 1)[0]
            out[name] = float(line.rsplit(" ", 1)[1])
    return out


def test_every_metric_the_dashboard_and_the_alerts_name_is_exported_by_a_real_daemon_or_kvd_control(etcd, tmp_path):
    import kvd

    secret = tmp_path / "secret"
    secret.write_bytes(os.urandom(32))
    secret.chmod(0o600)
    common = ["--cluster-secret-file", str(secret), "--data-listen", "127.0.0.1:0", "--etcd", etcd]
    b = Daemon([*common, "--node-id", "2"])
    a = Daemon([*common, "--node-id", "1"])
    seen: dict[str, float] = {}
    try:
        for d in (a, b):
            wait_until("the node holds its etcd lease", lambda d=d: scrape(d.admin).get("kvd_ready") == 1, 30)
        ns_desc = kvd.Namespace("deploy/test", "r1", 4096, 16, 1, 1, 64)
        with kvd.Client(a.socket, name="deploy-test") as c:
            ns = c.register_namespace(ns_desc)
            keys = [kvd.key(ns, bytes([i]) * 32) for i in range(4)]
            assert c.put(keys, [bytes([i]) * 4096 for i in range(4)]) == [None] * 4
            assert len(c.lookup_prefix(ns, [k[32:] for k in keys])) == 4

            def pushed(tid: int) -> bool:
                return c.transfers([tid])[0].state == "done"

            wait_until("node 2 is a peer", lambda: _try_push(c, keys), 30)
            # A checkpoint step on the holder (node 2): its blocks count as checkpoint class.
            c.manifest_begin(77, 1, ns, 0, 60_000)
            tags = kvd.block_tags(ns, 16, list(range(32)))
            ck = [kvd.key(ns, t) for t in tags]
            assert c.put(ck, [b"c" * 4096] * 2) == [None, None]
            tid = c.push_checkpoint(2, 77, 1, ck, 32, 60_000)
            wait_until("the checkpoint step arrived", lambda: pushed(tid), 30)
            seen.update(scrape(a.admin))
            seen.update(scrape(b.admin))
            assert scrape(a.admin)["kvd_cluster_mode"] == 1 and scrape(a.admin)["kvd_etcd_lease_held"] == 1
            # A drain that waits for this session's pin: scraped while it runs.
            pinned = c.acquire(keys[:1], 60_000)
            r = run(KVD, "drain", "--admin", a.admin)  # what the DaemonSet's preStop runs
            assert r.returncode == 0 and "accepted the drain" in r.stderr, r.stderr
            wait_until("the drain shows", lambda: scrape(a.admin).get("kvd_draining") == 1, 10)
            time.sleep(0.3)
            during = scrape(a.admin)
            seen.update(during)
            assert during["kvd_ready"] == 0 and during["kvd_drain_seconds"] > 0
            c.release([p.handle for p in pinned])
        r = run(KVD, "drain", "--admin", a.admin, "--wait-secs", "30")
        assert "exited" in r.stderr or "connecting to" in r.stderr, r.stderr  # gone, or going
        wait_until("the drained daemon exits 0", lambda: a.proc.poll() is not None, 30)
        assert a.proc.returncode == 0
    finally:
        a.stop()
        b.stop()
    # the recovery row and alert: kvd control's metrics (the front's counters are always there)
    ctl = subprocess.Popen([KVD, "control", "--listen", "127.0.0.1:0"], stdout=subprocess.PIPE, stderr=subprocess.DEVNULL)
    try:
        line = ctl.stdout.readline().decode()
        addr = re.search(r"listening on (\S+)", line).group(1)
        seen.update(scrape(addr))
    finally:
        ctl.kill()
        ctl.wait(timeout=30)
    named = set()
    for e in dashboard_exprs() + alert_exprs():
        named |= set(re.findall(r"\bkvd_[a-z0-9_]+", e))
    missing = sorted(n for n in named if n not in seen)
    assert not missing, f"named by the dashboard or the rules, not exported: {missing}"


def _try_push(c, keys) -> bool:
    import kvd

    try:
        tid = c.push(2, keys)
    except kvd.KvdError:
        return False
    for _ in range(200):
        t = c.transfers([tid])[0]
        if t.state != "in_flight":
            return t.state == "done"
        time.sleep(0.05)
    return False
