"""The studio's pure helpers: form <-> spec, field problems, cluster edits (no browser)."""
from __future__ import annotations

import json

import pytest

from backend.job.cluster import Cluster, GpuInfo, HostfileError, Node, local_cluster
from backend.job.demo import demo_spec
from backend.job.spec import FIELDS, JobSpec, Problem
from backend.job.validate import assess
from studio.cluster_view import node_rows, put_node, remove_node
from studio.context import Studio
from studio.form import GROUPS, VIEWS, default_form, form_to_data, problems_by_field, spec_to_form
from studio.train_view import (check_form, check_key, fix_for_label, fix_label, groups_with_errors, launch_refusal_md,
                               problem_lines)


def test_every_spec_field_is_on_the_form_once_with_its_flag():
    names = [name for _, _, group in GROUPS for name in group]
    assert sorted(names) == sorted(FIELDS)
    for name in FIELDS:
        assert VIEWS[name].label.endswith(f" · {name}")
        # The help is the description's first sentence, not a paragraph repeating the label's flag.
        assert "Flag:" not in VIEWS[name].info and len(VIEWS[name].info.split()) <= 50, (name, VIEWS[name].info)
    assert VIEWS["fsdp"].info == "FSDP2 (torch fully_shard): 'full_shard', 'shard_grad_op', add 'offload' for CPU offload."
    assert VIEWS["model"].info == "Local model directory or hub id (e.g. Qwen/Qwen2.5-0.5B-Instruct)."


def test_advanced_groups_start_collapsed():
    opened = {title: is_open for title, is_open, _ in GROUPS}
    assert opened["Advanced"] is False
    assert opened["Model and data"] is True


def test_round_trip_spec_form_spec():
    spec = JobSpec(model="m", dataset=["a.jsonl", "b.jsonl#10"], deepspeed="zero2", nproc_per_node=2,
                   env={"NCCL_DEBUG": "INFO"}, target_modules=["q_proj", "v_proj"], save_total_limit=3)
    values = default_form() | spec_to_form(spec.model_dump())
    data, problems = form_to_data(values)
    assert problems == []
    assert JobSpec(**data) == spec


def test_unset_optionals_fall_back_to_spec_defaults():
    values = default_form() | {"model": "m", "dataset": "a.jsonl", "nproc_per_node": 0, "deepspeed": ""}
    data, problems = form_to_data(values)
    assert problems == []
    assert "nproc_per_node" not in data and "deepspeed" not in data
    assert JobSpec(**data).nproc_per_node is None


def test_widget_level_problems_name_the_field():
    values = default_form() | {"model": "m", "dataset": "a", "max_length": 10.5, "env": "NCCL_DEBUG=INFO\nbroken"}
    _, problems = form_to_data(values)
    assert {p.field for p in problems} == {"max_length", "env"}
    assert any("line 2" in p.message for p in problems if p.field == "env")


def test_problems_split_by_field():
    by_field, other = problems_by_field([Problem("dataset.0", "bad"), Problem("cluster", "no GPUs"),
                                         Problem("dataset[1]", "file not found"),
                                         Problem("max_length", "too small")])
    assert set(by_field) == {"dataset", "max_length"}
    assert [p.field for p in other] == ["cluster"]


def test_check_form_marks_bad_field_and_derives_layout():
    cluster = Cluster(nodes=(Node(host="a", slots=4), Node(host="b", slots=4)))
    values = default_form() | {"model": "m", "dataset": "a.jsonl", "nnodes": 2, "tensor_model_parallel_size": 0}
    view = check_form(values, cluster)
    assert view.spec is None and not view.ok
    assert "tensor_model_parallel_size" in view.field_problems
    values["tensor_model_parallel_size"] = 1
    view = check_form(values, cluster)
    assert view.spec is not None
    assert "| 2 × 4 | 8 | 8 |" in view.layout_md
    assert "model: m" in view.yaml_text
    # TP, SP and PP can run here (SP on DeepSpeed, PP with more micro-batches: the form offers
    # each fix when they are set); nothing can on one rank.
    assert not {"tensor_model_parallel_size", "sequence_parallel_size", "pipeline_model_parallel_size"} & set(view.greyed)
    sp = check_form(values | {"sequence_parallel_size": 2}, cluster)
    assert "Ulysses" in sp.field_problems["deepspeed"][0].message and [f.text() for f in sp.fixes] == ["deepspeed zero0"]
    assert "deepspeed: zero0" in check_form(values | {"sequence_parallel_size": 2, "deepspeed": "zero0"}, cluster).yaml_text
    assert check_form(values | {"sequence_parallel_size": 2, "deepspeed": "zero2"}, cluster).fixes == []
    # A button drawn for one fix applies that fix or nothing: after the form changed (SP → EP), the
    # SP button's label finds no fix although a fix now sits in its place.
    ep = check_form(values | {"expert_model_parallel_size": 2}, cluster)
    assert fix_for_label(sp, fix_label(sp.fixes[0])) == sp.fixes[0]
    assert ep.fixes and fix_for_label(ep, fix_label(sp.fixes[0])) is None
    one = check_form(values | {"nnodes": 1, "nproc_per_node": 1}, cluster)
    assert "nothing to split" in one.greyed["tensor_model_parallel_size"]
    # A layout that is refused is not drawn, nor memory divided among its ranks.
    refused = check_form(values | {"tensor_model_parallel_size": 3}, cluster)
    assert refused.layout_md == "**Layout**: ✖ none: fix `tensor_model_parallel_size` first", refused.layout_md
    assert "not estimated" in refused.memory_md
    refused = check_form(values | {"sequence_parallel_size": 2}, cluster)  # set anyway (a YAML): an error, not greyed
    assert "sequence_parallel_size" not in refused.greyed and refused.commands.startswith("# fix the problems")


def test_put_and_remove_nodes():
    cluster = local_cluster(GpuInfo())
    cluster = put_node(cluster, {"host": "gpu1", "slots": 8.0, "addr": "10.0.0.2", "ssh_user": "ubuntu",
                                 "ssh_port": 22.0, "ssh_key": "", "python": "python3", "device": "cuda"})
    assert [n.host for n in cluster.nodes] == ["localhost", "gpu1"]
    assert cluster.nodes[1].slots == 8 and cluster.nodes[1].ssh_user == "ubuntu"
    # Same host again replaces it in place; the local node keeps its discovered fields.
    cluster = put_node(cluster, {"host": "localhost", "slots": 2})
    assert cluster.nodes[0].local and cluster.nodes[0].slots == 2
    assert node_rows(cluster)[1][:3] == ["gpu1", "10.0.0.2", 8]
    assert node_rows(cluster)[1][6].endswith("gpu1:22")  # SSH goes to the name; addr is the rendezvous's
    with pytest.raises(HostfileError) as err:
        put_node(cluster, {"host": "bad host!", "slots": 1})
    assert "host" in str(err.value)
    cluster = remove_node(cluster, "gpu1")
    assert [n.host for n in cluster.nodes] == ["localhost"]
    with pytest.raises(HostfileError):
        remove_node(cluster, "localhost")


def test_presets_save_and_load(tmp_path):
    studio = Studio(data_dir=tmp_path, output_dir=tmp_path / "out")
    spec = JobSpec(model="m", dataset=["d.jsonl"], learning_rate=3e-4)
    studio.save_preset("mine", spec)
    assert "mine" in studio.preset_names() and studio.preset_names()[0] == "demo"
    data, problems = studio.load_preset("mine")
    assert problems == [] and data["learning_rate"] == 3e-4
    with pytest.raises(ValueError, match="preset name"):
        studio.save_preset("../evil", spec)
    (studio.presets_dir / "broken.yaml").write_text("model: m\nlearning_rat: 1\n")
    data, problems = studio.load_preset("broken")
    assert data is None and any("did you mean 'learning_rate'" in p.message for p in problems)


def test_swift_command_round_trips_through_the_importer():
    from backend.job.msswift import import_command
    from backend.job.spec import parse_spec
    from studio.commands import swift_command

    spec = JobSpec(model="Qwen/Qwen2.5-7B-Instruct", dataset=["a.jsonl", "b.jsonl#100"], deepspeed="zero3",
                   nnodes=2, nproc_per_node=8, learning_rate=2e-5, gradient_checkpointing=False,
                   target_modules=["q_proj", "v_proj"], env={"NCCL_SOCKET_IFNAME": "eth0"})
    line = swift_command(spec, master_addr="10.0.0.1")
    assert line.startswith("NCCL_SOCKET_IFNAME=eth0 NPROC_PER_NODE=8 NNODES=2 NODE_RANK=0 MASTER_ADDR=10.0.0.1")
    assert "--max_length" not in line  # defaults stay off the line
    back, problems = parse_spec(import_command(line).spec)
    assert problems == [] and back == spec


def test_command_preview_shows_every_node_and_the_ds_config():
    from studio.commands import preview

    cluster = Cluster(nodes=(Node(host="a", slots=4), Node(host="b", slots=4, addr="10.0.0.2")))
    spec = JobSpec(model="m", dataset=["d.jsonl"], nnodes=2, deepspeed="zero2", per_device_train_batch_size=2)
    text, ds = preview(assess(spec, cluster))
    assert "# node 0: a" in text and "# node 1: b" in text and "--node_rank 1" in text
    assert "swift sft" in text and ds["train_batch_size"] == 2 * 8


def studio_with_db(tmp_path) -> Studio:
    from backend.runs.manager import RunManager

    studio = Studio(data_dir=tmp_path, output_dir=tmp_path / "out")
    studio.manager_future.set_result(RunManager(f"sqlite:///{tmp_path / 'studio.db'}"))
    return studio


def test_cluster_survives_a_restart_in_the_node_inventory(tmp_path):
    studio = studio_with_db(tmp_path)
    cluster, setups = studio.load_cluster()
    assert cluster.is_local and setups == {}
    cluster = put_node(put_node(local_cluster(), {"host": "localhost", "slots": 2}),
                       {"host": "gpu1", "slots": 8, "addr": "10.0.0.2", "ssh_key": "~/.ssh/id"})
    assert studio.save_cluster(cluster, {"gpu1": "source ~/venv/bin/activate"}) == {"gpu1": "source ~/venv/bin/activate"}
    # A change of nodes keeps each node's setup line; the line is what launch and pre-flight use.
    changed = put_node(cluster, {"host": "gpu1", "slots": 4, "addr": "10.0.0.2", "ssh_key": "~/.ssh/id"})
    assert studio.save_cluster(changed) == {"gpu1": "source ~/venv/bin/activate"}
    again, setups = studio_with_db(tmp_path).load_cluster()
    assert [(n.host, n.slots, n.local) for n in again.nodes] == [("localhost", 2, True), ("gpu1", 4, False)]
    assert again.nodes[1].ssh_key == "~/.ssh/id" and setups == {"gpu1": "source ~/venv/bin/activate"}
    from backend.cluster.nodes import setups_for

    assert setups_for(studio.manager.engine, again) == {"gpu1": "source ~/venv/bin/activate"}
    # The nodes table shows the lines; a hostfile without gpu1 drops it and its line.
    assert node_rows(again, setups)[1][-1] == "source ~/venv/bin/activate"
    assert studio.save_cluster(remove_node(again, "gpu1")) == {}
    assert [n.host for n in studio.load_cluster()[0].nodes] == ["localhost"]


def test_an_older_studios_cluster_file_is_read_into_the_inventory_once(tmp_path):
    (tmp_path / "cluster.json").write_text(json.dumps([{"host": "a", "slots": 2, "device": "cpu"},
                                                       {"host": "b", "slots": 2, "device": "cpu"}]))
    studio = studio_with_db(tmp_path)
    # A row an older version wrote (no place in the cluster) keeps its setup line through the import.
    from backend.cluster.nodes import inventory
    from backend.store.models import NodeRecord
    from sqlmodel import Session

    with Session(studio.manager.engine) as s:
        s.add(NodeRecord(host="b", slots=2, device="cpu", setup="source /opt/b/venv/bin/activate"))
        s.commit()
    cluster, setups = studio.load_cluster()
    assert [n.host for n in cluster.nodes] == ["a", "b"] and setups == {"b": "source /opt/b/venv/bin/activate"}
    (tmp_path / "cluster.json").write_text("not json")  # read no more: the inventory has the nodes
    assert [n.host for n in studio_with_db(tmp_path).load_cluster()[0].nodes] == ["a", "b"]
    assert (tmp_path / "cluster.json").read_text() == "not json"  # left as it was
    assert len(inventory(studio.manager.engine)) == 2


def test_node_edits_apply_to_the_stored_inventory_and_keep_setup_lines(tmp_path):
    from studio.cluster_tab import CLEAR_SETUP, put_in_inventory

    first, second = studio_with_db(tmp_path), studio_with_db(tmp_path)  # two pages, or two studios
    first.save_cluster(put_node(local_cluster(), {"host": "gpu1", "slots": 8}))
    # The second adds a node with a setup line; the first, whose page still shows one node, adds
    # another: nothing of the second's is lost.
    put_in_inventory(second, {"host": "gpu2", "slots": 8}, "module load cuda")
    cluster, setups = put_in_inventory(first, {"host": "gpu3", "slots": 8}, "")
    assert [n.host for n in cluster.nodes] == ["localhost", "gpu1", "gpu2", "gpu3"]
    assert setups == {"gpu2": "module load cuda"}
    # Changing a node with the line left empty keeps it; the clear mark removes it.
    assert put_in_inventory(first, {"host": "gpu2", "slots": 4}, "")[1] == {"gpu2": "module load cuda"}
    assert put_in_inventory(first, {"host": "gpu2", "slots": 4}, CLEAR_SETUP)[1] == {}
    # A node left out (this machine only) keeps its line for the CLI's --hostfile runs, and has it
    # again when it comes back.
    put_in_inventory(first, {"host": "gpu1", "slots": 8}, "source ~/venv/bin/activate")
    first.save_cluster(local_cluster())
    from backend.cluster.nodes import setups_for

    assert setups_for(first.manager.engine, put_node(local_cluster(), {"host": "gpu1", "slots": 8})) == {
        "gpu1": "source ~/venv/bin/activate"}
    assert [n.host for n in first.load_cluster()[0].nodes] == ["localhost"]


def test_no_node_edit_is_written_while_the_inventory_cannot_be_read(tmp_path):
    from studio.cluster_tab import put_in_inventory

    alone = Studio(data_dir=tmp_path, output_dir=tmp_path / "out")
    alone.manager_future.set_exception(RuntimeError("the database is locked"))
    with pytest.raises(RuntimeError, match="locked"):
        put_in_inventory(alone, {"host": "gpu1", "slots": 8}, "")


def test_a_broken_cluster_file_or_no_manager_shows_this_machine(tmp_path):
    (tmp_path / "cluster.json").write_text("not json")
    assert studio_with_db(tmp_path).load_cluster()[0].is_local
    alone = Studio(data_dir=tmp_path, output_dir=tmp_path / "out")
    alone.manager_future.set_exception(RuntimeError("the database is locked"))
    assert alone.load_cluster()[0].is_local


def test_missing_deepspeed_json_is_a_field_error_not_a_crash(tmp_path):
    # The memory estimate reads the JSON too; it must not take the whole check down with it.
    missing = str(tmp_path / "nope.json")
    values = default_form() | spec_to_form(demo_spec().model_dump()) | {"deepspeed": missing}
    view = check_form(values, local_cluster())
    assert not view.ok
    assert any(missing in p.message for p in view.field_problems["deepspeed"])
    assert view.memory_md.startswith("**Memory per GPU**: not estimated:")
    assert missing in view.memory_md


def test_problem_list_links_each_field_errors_first():
    cluster = local_cluster()
    values = default_form() | spec_to_form(demo_spec().model_dump()) | {
        "model": "/nonexistent/model", "attn_impl": "bogus", "save_steps": 1000, "max_steps": 10}
    view = check_form(values, cluster)
    lines = problem_lines(view)
    errors = problem_lines(view, errors_only=True)
    assert lines[: len(errors)] == errors and all("✖" in line for line in errors)
    assert errors[0].startswith("- ✖ [Model · model](#f-model): ")
    assert errors[-1].startswith("- ✖ [Attention kernel · attn_impl](#f-attn_impl): ")
    assert lines[len(errors)].startswith("- ⚠ [Save steps · save_steps](#f-save_steps): ")  # a warning, after them
    refusal = launch_refusal_md(view)
    assert refusal.startswith(f"✖ **Not launched**: fix these {len(errors)} problems first.\n\n{errors[0]}")
    # "Advanced" starts collapsed: a refusal opens it so that the mark can be seen; a warning opens nothing.
    assert groups_with_errors(view) == ["Model and data", "Advanced"]


def test_a_fill_echoed_back_by_the_browser_is_the_same_check():
    # A fill sets the widgets from the spec; the browser reports them back as strings and floats.
    cluster = local_cluster()
    filled = default_form() | spec_to_form(demo_spec().model_dump())
    echoed = {name: (float(v) if isinstance(v, int) and not isinstance(v, bool) else v) for name, v in filled.items()}
    echoed |= {"deepspeed": None, "save_total_limit": 2.0}
    assert check_key(echoed, cluster) == check_key(filled, cluster)
    assert check_key(filled | {"model": "/other"}, cluster) != check_key(filled, cluster)
    assert check_key(filled, Cluster(nodes=(Node(host="a", slots=4),))) != check_key(filled, cluster)


def test_one_form_change_reads_each_file_and_estimates_once(tmp_path, monkeypatch):
    """The check of a form state (problems, memory, plan preview) and the launch it leads to share one
    assessment: one read of the model config and of the DeepSpeed JSON, one memory estimate."""
    from backend.job import dsconfig, planner, validate
    from backend.runs.driver import assesses as _assesses

    calls = {"model": 0, "json": 0, "memory": 0}

    def counted(name, fn):
        def wrapper(*args, **kwargs):
            calls[name] += 1
            return fn(*args, **kwargs)
        return wrapper

    monkeypatch.setattr(validate, "find_model_config", counted("model", validate.find_model_config))
    monkeypatch.setattr(dsconfig, "load_user_config", counted("json", dsconfig.load_user_config))
    estimate = counted("memory", validate.estimate_memory)
    monkeypatch.setattr(validate, "estimate_memory", estimate)
    monkeypatch.setattr(planner, "estimate_memory", estimate)
    ds = tmp_path / "ds.json"
    ds.write_text(json.dumps({"zero_optimization": {"stage": 2}, "train_micro_batch_size_per_gpu": "auto"}))
    spec = demo_spec(output_dir=str(tmp_path / "out")).model_copy(update={"deepspeed": str(ds)})
    cluster = local_cluster(GpuInfo())
    view = check_form(default_form() | spec_to_form(spec.model_dump()), cluster)
    assert view.ok, view.other_problems
    assert "Memory per GPU: ~" in view.memory_md and "torch.distributed.run" in view.commands
    assert '"stage": 2' in view.ds_json
    assert calls == {"model": 1, "json": 1, "memory": 1}
    # The launch of that form takes the same assessment (the manager plans from it, reading nothing).
    assert _assesses(view.assessment, view.spec.model_copy(update={"output_dir": "/abs/out"}), cluster)
    assert not _assesses(view.assessment, view.spec.model_copy(update={"learning_rate": 0.5}), cluster)


def test_two_studios_adding_the_same_new_node_at_once_both_succeed(tmp_path, monkeypatch):
    """Both read an inventory without the node, then both insert it: the second's unique-host
    conflict is written again over the first's row, not shown as a failure."""
    import threading

    from backend.cluster import nodes
    from backend.runs.manager import RunManager

    managers = [RunManager(f"sqlite:///{tmp_path / 'studio.db'}", reattach=False) for _ in range(2)]
    cluster = put_node(local_cluster(), {"host": "gpu9", "slots": 8})
    both_read, waited, real_exec = threading.Barrier(2), set(), nodes.Session.exec

    def read_then_wait(self, statement, *args, **kwargs):
        rows = list(real_exec(self, statement, *args, **kwargs))
        if threading.get_ident() not in waited:  # each writer's first read, before either writes
            waited.add(threading.get_ident())
            both_read.wait(timeout=10)
        return rows

    monkeypatch.setattr(nodes.Session, "exec", read_then_wait)
    failed = []

    def add(manager, line):
        try:
            manager.set_inventory(cluster, {"gpu9": line})
        except Exception as exc:  # noqa: BLE001 - the assertion below names it
            failed.append(exc)

    threads = [threading.Thread(target=add, args=(m, line)) for m, line in zip(managers, ("one", "two"))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=30)
    monkeypatch.undo()
    assert failed == []
    found, setups = managers[0].node_inventory()
    assert [n.host for n in found.nodes] == ["localhost", "gpu9"] and setups["gpu9"] in ("one", "two")
    for m in managers:
        m.close()


def test_on_a_slurm_partition_the_form_is_checked_on_the_allocation_and_previews_the_batch_script():
    from studio.cluster_view import slurm_form, slurm_settings

    values = default_form() | spec_to_form(demo_spec().model_dump()) | {"nnodes": 2, "nproc_per_node": 4}
    settings = slurm_settings({"partition": " debug ", "gpus_per_node": None, "cpus_per_task": 4.0,
                               "time_limit": "", "account": None, "python": "/opt/venv/bin/python",
                               "extra": "qos=high\n\n --constraint=a100 \n"})
    assert settings == {"partition": "debug", "gpus_per_node": 0, "cpus_per_task": 4, "time_limit": None,
                        "account": None, "python": "/opt/venv/bin/python", "extra": ["qos=high", "--constraint=a100"]}
    assert slurm_settings(dict(zip(("partition", "gpus_per_node", "cpus_per_task", "time_limit", "account", "python",
                                    "extra"), slurm_form(settings)))) == settings
    view = check_form(values, local_cluster(), settings)
    assert view.ok, problem_lines(view)
    assert view.slurm.nodes == 2 and view.assessment.cluster.source == "slurm partition debug"
    assert "| 2 × 4 | 8 |" in view.layout_md
    assert "#SBATCH --partition=debug" in view.commands and "#SBATCH --nodes=2" in view.commands
    assert "#SBATCH --qos=high" in view.commands and "srun" in view.commands
    bad = check_form(values, local_cluster(), settings | {"partition": "no such!", "cpus_per_task": 2.5})
    assert not bad.ok and {p.field for p in bad.other_problems} >= {"slurm.partition", "slurm.cpus_per_task"}
    spaced = check_form(values | {"output_dir": "/tmp/my runs"}, local_cluster(), settings)
    assert not spaced.ok and "output_dir" in spaced.field_problems, problem_lines(spaced)
    assert check_key(values, local_cluster(), settings) != check_key(values, local_cluster(), None)


def test_studio_settings_keep_each_other(tmp_path):
    from studio.context import Studio

    studio = Studio(tmp_path, tmp_path / "out")
    studio.save_gpu_hour_price(2.5)
    studio.save_slurm_settings({"partition": "debug"})
    assert studio.gpu_hour_price() == 2.5 and studio.slurm_settings()["partition"] == "debug"
    studio.save_slurm_settings(None)
    assert studio.slurm_settings() is None and studio.gpu_hour_price() == 2.5
    # Edited by hand: unknown keys dropped, values kept for the target's check to name.
    (tmp_path / "settings.json").write_text('{"slurm": {"partition": "debug", "nodes": 9, "extra": "qos=high", '
                                            '"gpus_per_node": "8"}}')
    settings = studio.slurm_settings()
    assert settings == {"partition": "debug", "gpus_per_node": "8", "cpus_per_task": None, "time_limit": None,
                        "account": None, "python": None, "extra": ["qos=high"]}
    from backend.cluster.slurm import SlurmTarget
    assert [p.field for p in SlurmTarget.for_job(None, **settings)[1]] == ["slurm.gpus_per_node"]
    (tmp_path / "settings.json").write_text('{"slurm": {"partition": "debug", "cpus_per_task": NaN, '
                                            '"gpus_per_node": 1e999}}')
    settings = studio.slurm_settings()
    assert sorted(p.field for p in SlurmTarget.for_job(None, **settings)[1]) == ["slurm.cpus_per_task",
                                                                                 "slurm.gpus_per_node"]
    # Two handlers at once (Gradio's worker threads): neither update is lost, nothing raises.
    from concurrent.futures import ThreadPoolExecutor
    with ThreadPoolExecutor(8) as pool:
        list(pool.map(lambda i: studio.save_gpu_hour_price(1.0 + i) if i % 2 else
                      studio.save_slurm_settings({"partition": f"p{i}"}), range(64)))
    assert studio.gpu_hour_price() is not None and studio.slurm_settings()["partition"].startswith("p")
    (tmp_path / "settings.json").write_text("[1, 2]")  # not ours: read as no settings, not a crash
    assert studio.slurm_settings() is None and studio.gpu_hour_price() is None


def test_a_page_load_sets_the_slurm_target_after_the_fill_and_the_form_is_checked_one_at_a_time(tmp_path):
    """The Slurm target is set after the form is filled (its change checks the form with the values
    the page shows: a check of the empty form sent before the fill landed once ended after it, and a
    reload's preview stayed at "fix the problems"), and the form's checks end in the order asked."""
    from studio.app import build_app

    app = build_app(Studio(tmp_path, tmp_path / "runs"))
    [slurm_load] = [fn for fn in app.fns.values() if fn.fn and "wire_slurm" in fn.fn.__qualname__ and fn.name == "on_load"]
    assert [trigger for _, trigger in slurm_load.targets] == ["then"]
    checks = [fn for fn in app.fns.values() if fn.name == "on_edit"]
    assert checks and {(fn.concurrency_id, fn.concurrency_limit) for fn in checks} == {("train-check", 1)}
