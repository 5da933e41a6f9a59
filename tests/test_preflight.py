"""Pre-flight: the pure evaluation of node reports, and real runs over OpenSSH on loopback nodes."""
from __future__ import annotations

import asyncio
import dataclasses
import os
import shutil
import time
from pathlib import Path

import pytest

from backend.cluster import ssh
from backend.cluster import preflight as pf
from backend.cluster.nodes import Pool
from backend.job.cluster import Cluster, Node
from backend.job.spec import JobSpec
from sshd import free_port
from worker import ROOT as REPO


def report_data(**over):
    data = {"time": time.time(), "python": "3.11.7", "executable": "/usr/bin/python3", "hostname": "h",
            "packages": {p: {"version": "1.0", "path": f"/site/{p}"} for p in pf.PACKAGES},
            "cuda": "12.4", "nccl": "2.21.5", "gpus": [], "driver": None, "token_written": True,
            "disk_free_gib": 500.0, "interfaces": ["lo", "eth0", "ib0"]}
    data.update(over)
    return data


def probe(host, device="cpu", slots=1, skew=0.0, **over):
    p = pf._NodeProbe(Node(host=host, slots=slots, device=device), None, report_data(**over))
    now = time.time()
    p.data["time"] = now + skew
    p.rtt = (now - 0.01, now + 0.01)
    return p


def rows(probes, spec=None, ifname=None):
    return {(r.node, r.check): r for r in pf.evaluate_round1(probes, spec, ifname)}


def failures_left_unread(wait) -> list[str]:
    """What asyncio reports once a shell command waited on by `wait(work, timeout_s)` is cancelled
    with its caller and then fails (the connection closed under it, as when a watch stops)."""
    import contextlib
    import gc

    async def command():
        try:
            await asyncio.sleep(10)
        except asyncio.CancelledError:
            raise ssh.Unreachable(ssh.Address("127.0.0.2"), "connection lost") from None

    async def main() -> list[str]:
        seen = []
        asyncio.get_running_loop().set_exception_handler(lambda loop, context: seen.append(context["message"]))
        caller = asyncio.ensure_future(wait(command(), 5))
        await asyncio.sleep(0.01)
        caller.cancel()
        # 3.12's wait_for passes the command's failure to the caller in place of the cancellation
        with contextlib.suppress(asyncio.CancelledError, ssh.Unreachable):
            await caller
        del caller
        gc.collect()
        return seen

    return asyncio.run(main())


def test_a_shell_command_cancelled_with_its_caller_leaves_no_failure_unread():
    """ssh.within (the watch's probes, the chat worker's shell) reads the command's own failure;
    Python 3.10 and 3.11's asyncio.wait_for leaves it to be logged when collected (in a CI run, during
    the architecture test's ast.parse, where 3.11 raised SystemError printing it)."""
    import sys

    stock = failures_left_unread(asyncio.wait_for)
    assert stock == (["Task exception was never retrieved"] if sys.version_info < (3, 12) else [])
    assert failures_left_unread(ssh.within) == []


def test_identical_nodes_pass():
    r = rows([probe("a"), probe("b")])
    assert all(x.status == "ok" for x in r.values()), [x for x in r.values() if x.status != "ok"]


def test_clock_skew_allows_for_the_round_trip():
    assert pf.clock_skew(105.0, 100.0, 110.0) == 0.0  # a slow answer is no skew
    assert pf.clock_skew(93.0, 100.0, 101.0) == -7.0
    assert pf.clock_skew(108.5, 100.0, 101.0) == 7.5


def test_clock_skew_over_five_seconds_is_an_error():
    r = rows([probe("a"), probe("b", skew=7.5), probe("c", skew=2.0)])
    assert r[("b", "clock")].status == "error" and "+7.49 s" in r[("b", "clock")].reason
    assert r[("b", "clock")].fix
    assert r[("c", "clock")].status == "warning"


def test_version_mismatch_names_node_package_and_master_version():
    other = report_data()["packages"] | {"deepspeed": {"version": "0.0.1", "path": "/tmp/fake/deepspeed"}}
    r = rows([probe("a"), probe("b", packages=other)])
    cell = r[("b", "deepspeed")]
    assert cell.status == "error"
    assert "0.0.1" in cell.reason and "/tmp/fake/deepspeed" in cell.reason and "1.0" in cell.reason
    assert r[("a", "deepspeed")].status == "ok"


def test_missing_package_is_an_error_with_install_fix():
    pkgs = report_data()["packages"] | {"peft": {"version": None, "path": None}}
    cell = rows([probe("a", packages=pkgs)])[("a", "peft")]
    assert cell.status == "error" and "pip install peft" in cell.fix


def test_gpu_rules():
    gpu = {"name": "H200", "used_gib": 0.2, "total_gib": 140}
    spec = JobSpec(model="m", dataset=["d"], nproc_per_node=4, nnodes=3)
    r = rows([probe("a", "cuda", 8, gpus=[gpu] * 8, driver="570.1"),
              probe("b", "cuda", 8, gpus=[gpu] * 2, driver="570.1"),
              probe("c", "cuda", 8, gpus=[gpu, {**gpu, "used_gib": 30.0}] * 2, driver="570.1")], spec)
    assert r[("a", "gpus")].status == "ok" and "driver 570.1" in r[("a", "gpus")].reason
    assert r[("b", "gpus")].status == "error" and "nproc_per_node=4" in r[("b", "gpus")].reason
    assert r[("c", "gpus")].status == "warning" and "30.0 GiB" in r[("c", "gpus")].reason
    assert r[("a", "cuda")].status == "ok"


def test_cuda_mismatch_on_gpu_nodes():
    gpu = [{"name": "H200", "used_gib": 0, "total_gib": 140}]
    r = rows([probe("a", "cuda", gpus=gpu), probe("b", "cuda", gpus=gpu, cuda="11.8")])
    assert r[("b", "cuda")].status == "error"


def test_network_interface():
    r = rows([probe("a"), probe("b", interfaces=["lo", "ens5"])], ifname="eth")
    assert r[("a", "interface")].status == "ok"
    assert r[("b", "interface")].status == "error" and "ens5" in r[("b", "interface")].reason
    assert pf._iface_ok("=eth0", ["eth0"]) and not pf._iface_ok("=eth", ["eth0"])
    assert pf._iface_ok("^docker,eth", ["eth1"]) and pf._iface_ok("^docker", ["lo"])


def test_low_disk():
    r = rows([probe("a", disk_free_gib=0.5), probe("b", disk_free_gib=10.0)])
    assert r[("a", "disk")].status == "error" and r[("b", "disk")].status == "warning"


# -- real nodes ------------------------------------------------------------------------------


def ssh_nodes(sshd_nodes):
    return list(sshd_nodes.nodes())


def run(sshd_nodes, nodes, tmp_path, setups=None, bandwidth=False, spec_env=None, model="m", nnodes=None, **fields):
    spec = JobSpec(model=str(model), dataset=["d"], nnodes=nnodes or len(nodes), output_dir=str(tmp_path / "out"),
                   env=spec_env or {}, **fields)
    setups = setups or sshd_nodes.setups()

    async def go():
        pool = Pool(sshd_nodes.known_hosts)
        try:
            return await pf.run_preflight(pool, Cluster(tuple(nodes)), spec, setups, bandwidth=bandwidth)
        finally:
            await pool.close()

    return asyncio.run(go())


@pytest.mark.e2e
def test_good_nodes_pass_with_bandwidth(sshd_nodes, tmp_path):
    nodes = ssh_nodes(sshd_nodes)
    report = run(sshd_nodes, nodes, tmp_path, bandwidth=True, spec_env={"NCCL_SOCKET_IFNAME": "lo"},
                 model=REPO / "assets" / "demo" / "model")
    assert report.ok, report.text()
    for node in nodes:
        for check in ("ssh", "clock", "python", "torch", "deepspeed", "transformers", "peft", "gpus", "disk",
                      "interface", "shared_dir", "model", "port"):
            assert report.get(node.host, check) is not None, (node.host, check)
    assert report.get(nodes[1].host, "port").reason.startswith("reaches the master's rendezvous port")
    assert report.bandwidth["world_size"] == 2 and report.bandwidth["busbw_gib_s"] > 0
    assert "bus bandwidth" in report.get(nodes[0].host, "bandwidth").reason
    # the tokens were cleaned up
    assert not list((tmp_path / "out").glob(f"{pf.TOKEN_DIR}/*"))


@pytest.mark.e2e
def test_bad_nodes_are_named(sshd_nodes, tmp_path):
    good, second = ssh_nodes(sshd_nodes)
    fake = tmp_path / "fake" / "deepspeed"
    fake.mkdir(parents=True)
    (fake / "__init__.py").write_text("__version__ = '0.0.1+fake'\n")
    closed = dataclasses.replace(second, ssh_port=free_port(second.host))  # nobody listens there
    wrong_key = dataclasses.replace(second, ssh_key=str(sshd_nodes.root / "hostkey_127.0.0.2"))
    # the second node's setup line puts a fake deepspeed first on PYTHONPATH
    setups = {good.host: sshd_nodes.setup, second.host: f"{sshd_nodes.setup}:{fake.parent}"}
    t = time.monotonic()
    report = run(sshd_nodes, [good, second], tmp_path, setups=setups)
    assert report.get(second.host, "deepspeed").status == "error"
    assert "0.0.1+fake" in report.get(second.host, "deepspeed").reason
    assert report.get(good.host, "deepspeed").status == "ok"

    # A truncated model on the nodes: each node's copy is read there, the file named.
    model = Path(shutil.copytree(REPO / "assets" / "demo" / "model", tmp_path / "model"))
    os.truncate(model / "model.safetensors", 1000)
    report = run(sshd_nodes, [good, second], tmp_path, model=model)
    assert {(r.node, r.check) for r in report.errors()} == {(good.host, "model"), (second.host, "model")}
    assert report.get(good.host, "model").reason.startswith(f"{model / 'model.safetensors'}: ")
    report = run(sshd_nodes, [good, second], tmp_path, model=tmp_path / "nowhere")
    assert report.get(second.host, "model").reason == f"{tmp_path / 'nowhere'}: no such directory on this node"
    # Full DPO's reference model is loaded on every node too: its weights are read there (no tokenizer needed).
    report = run(sshd_nodes, [good, second], tmp_path, model=REPO / "assets" / "demo" / "model", rlhf_type="dpo",
                 train_type="full", ref_model=str(model))
    assert {(r.node, r.check) for r in report.errors()} == {(good.host, "ref_model"), (second.host, "ref_model")}
    assert report.get(good.host, "ref_model").reason.startswith(f"{model / 'model.safetensors'}: ")
    assert report.get(good.host, "model").reason.startswith("weights and tokenizer whole in ")

    report = run(sshd_nodes, [good, closed], tmp_path)
    [cell] = [r for r in report.errors() if r.check == "ssh"]
    assert cell.node == second.host and f"port {closed.ssh_port}" in cell.reason and "refused" in cell.reason
    # A job of fewer nodes than the cluster has: the others are shown, not checked, and why.
    report = run(sshd_nodes, [good, closed], tmp_path, nnodes=1)
    assert report.ok and report.table()[0] == [good.host, second.host], report.text()
    left_out = report.get(second.host, "ssh")
    assert (left_out.status, left_out.reason) == ("skipped", "not checked: the job (nnodes: 1) runs on the first 1 "
                                                             "of the cluster's 2 nodes")

    report = run(sshd_nodes, [good, wrong_key], tmp_path)
    [cell] = [r for r in report.errors() if r.check == "ssh"]
    assert cell.node == second.host and "permission denied" in cell.reason and cell.fix
    assert time.monotonic() - t < 30


@pytest.mark.e2e
def test_unknown_and_changed_host_keys(sshd_nodes, tmp_path):
    node = ssh_nodes(sshd_nodes)[0]
    address = ssh.Address(node.host, node.ssh_port, "root", node.ssh_key)
    empty = tmp_path / "known_hosts"

    async def go():
        with pytest.raises(ssh.HostKeyError, match="unknown"):
            await ssh.connect(address, empty)
        changed = tmp_path / "changed"
        changed.write_text(f"[{node.host}]:{node.ssh_port} {sshd_nodes.servers[1].host_pub}\n")
        with pytest.raises(ssh.HostKeyError, match="CHANGED"):
            await ssh.connect(address, changed)
        with pytest.raises(ssh.HostKeyError, match="not the expected"):
            await ssh.trust_host_key(address, empty, expected_fingerprint="SHA256:nope")
        fingerprint = await ssh.trust_host_key(address, empty)
        shell = await ssh.connect(address, empty)
        assert (await shell.run("echo ok")).stdout.strip() == "ok"
        await shell.close()
        return fingerprint

    assert asyncio.run(go()).startswith("SHA256:")
