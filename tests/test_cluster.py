"""Hostfiles parse as DeepSpeed parses them (plus our key=value words); node lists; local machine."""
from __future__ import annotations

import sys

import pytest

from backend.job.cluster import (GpuInfo, HostfileError, cluster_from_dicts, local_cluster, parse_hostfile, usable_cores,
                             parse_hostfile_text)

GOOD_FILES = {
    "plain": "worker-0 slots=8\nworker-1 slots=8\n",
    "comments_blanks": "# the cluster\n\nworker-0 slots=4\n   \n# gpu box 2\nworker-1 slots=2\n",
    "extra_keys": ("10.0.0.1 slots=8 ssh_user=ubuntu ssh_port=2222 ssh_key=/home/u/.ssh/id_ed25519\n"
                   "node-b slots=8 addr=10.0.0.2 python=/opt/venv/bin/python\n"),
    "loopback_cpu": "127.0.0.2 slots=2 device=cpu ssh_port=2222\n127.0.0.3 slots=2 device=cpu ssh_port=2223\n",
    "trailing_comment": "node-a slots=4 # rack 3\nnode-b slots=4 ssh_user=root # rack 4\n",
    "tabs": "node-a\tslots=1\n",
}
BAD_FILES = {
    "duplicate": ("a slots=1\nb slots=1\na slots=2\n", ":3", "duplicate host 'a' (first on line 1)"),
    "no_slots": ("a slots=1\nb\n", ":2", "expected 'hostname slots=N"),
    "bad_slots": ("a slots=x\n", ":1", "expected 'hostname slots=N"),
    "empty": ("# nothing\n\n", "", "no hosts"),
}


def deepspeed_parse(path):
    from deepspeed.launcher.runner import fetch_hostfile

    return fetch_hostfile(str(path))


@pytest.mark.parametrize("name", sorted(GOOD_FILES))
def test_hosts_and_slots_match_deepspeed(tmp_path, name):
    path = tmp_path / "hostfile"
    path.write_text(GOOD_FILES[name])
    ours = parse_hostfile(path)
    assert {n.host: n.slots for n in ours.nodes} == dict(deepspeed_parse(path))
    assert [n.host for n in ours.nodes] == list(deepspeed_parse(path))  # same order (rank order)


@pytest.mark.parametrize("name", sorted(BAD_FILES))
def test_files_deepspeed_rejects_are_rejected_with_the_line(tmp_path, name):
    text, line, message = BAD_FILES[name]
    path = tmp_path / "hostfile"
    path.write_text(text)
    with pytest.raises(ValueError):
        deepspeed_parse(path)
    with pytest.raises(HostfileError) as err:
        parse_hostfile(path)
    first = err.value.problems[0]
    assert first.field == f"{path}{line}" and message in first.message


def test_extra_keys_are_read():
    cluster = parse_hostfile_text(GOOD_FILES["extra_keys"])
    a, b = cluster.nodes
    assert (a.ssh_user, a.ssh_port, a.ssh_key, a.address) == ("ubuntu", 2222, "/home/u/.ssh/id_ed25519", "10.0.0.1")
    assert (b.addr, b.python, b.ssh_port, b.device) == ("10.0.0.2", "/opt/venv/bin/python", 22, "cuda")
    assert cluster.backend == "nccl" and not cluster.all_loopback


def test_loopback_cpu_cluster_uses_gloo():
    cluster = parse_hostfile_text(GOOD_FILES["loopback_cpu"])
    assert cluster.backend == "gloo" and cluster.all_loopback and not cluster.is_local


def test_every_bad_word_is_reported_with_its_line():
    text = "a slots=2 ssh_port=99999 colour=red\nb slots=0\nc slots=1 device=tpu nonsense\n"
    with pytest.raises(HostfileError) as err:
        parse_hostfile_text(text, source="hosts")
    lines = [str(p) for p in err.value.problems]
    assert lines == [
        "hosts:1: ssh_port must be a port number 1-65535, got '99999'",
        "hosts:1: unknown key 'colour'; known: addr, ssh_user, ssh_port, ssh_key, python, device, gpu_mem_gib, host_mem_gib",
        "hosts:2: b: slots must be at least 1",
        "hosts:3: device must be one of cuda, cpu, got 'tpu'",
        "hosts:3: expected key=value after slots=N, got 'nonsense'",
    ]


def test_missing_and_unreadable_hostfile(tmp_path):
    with pytest.raises(HostfileError, match="hostfile not found"):
        parse_hostfile(tmp_path / "absent")
    with pytest.raises(HostfileError, match="cannot read"):
        parse_hostfile(tmp_path)  # a directory


@pytest.mark.parametrize("name", sorted(GOOD_FILES))
def test_hostfile_text_round_trip(name):
    cluster = parse_hostfile_text(GOOD_FILES[name])
    assert parse_hostfile_text(cluster.to_hostfile()).nodes == cluster.nodes


def test_dict_round_trip_and_errors():
    cluster = parse_hostfile_text(GOOD_FILES["extra_keys"])
    assert cluster_from_dicts(cluster.to_dicts()).nodes == cluster.nodes
    with pytest.raises(HostfileError) as err:
        cluster_from_dicts([{"host": "a", "slots": 2}, {"host": "a", "slots": 1}, {"host": "b", "slots": "2"},
                            {"host": "c", "slots": 1, "ssh_port": "x", "flavour": 1}])
    assert [str(p) for p in err.value.problems] == [
        "nodes[1].host: duplicate host 'a'",
        "nodes[2].slots: must be a whole number >= 1, got '2'",
        "nodes[3]: unknown key(s): flavour",
        "nodes[3].ssh_port: ssh_port must be a port number 1-65535, got 'x'",
    ]


def test_local_cluster_with_and_without_gpus():
    gpu = local_cluster(GpuInfo(("NVIDIA H200", "NVIDIA H200"), 139.8))
    node = gpu.nodes[0]
    assert gpu.is_local and gpu.backend == "nccl" and node.slots == 2 and node.gpu_mem_gib == 139.8
    assert node.address == "127.0.0.1" and node.python == sys.executable
    cpu = local_cluster(GpuInfo())
    assert cpu.backend == "gloo" and cpu.nodes[0].slots == usable_cores() and cpu.nodes[0].device == "cpu"


def test_local_cluster_probes_nvml():
    """On this CPU machine NVML is missing: a slot per core. On a GPU machine: one slot per GPU."""
    cluster = local_cluster()
    node = cluster.nodes[0]
    assert node.local and node.slots >= 1
    assert (node.device == "cuda") == bool(node.gpu_names)
