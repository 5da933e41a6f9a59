"""The Train and Cluster tabs in a real browser: live field errors, layout, command preview,
import of an ms-swift command, presets, hostfile errors, and no request leaving the machine."""
from __future__ import annotations

import re
from contextlib import contextmanager

import pytest

pytest.importorskip("playwright")
from playwright.sync_api import expect, sync_playwright  # noqa: E402

from studio_server import (Shots, foreign_requests, launch_browser, open_studio, reload_studio,  # noqa: E402
                           start_studio)

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(240)]

from studio_server import REPO  # noqa: E402

from backend.job.cluster import usable_cores  # noqa: E402
from worker import preference_pairs, until  # noqa: E402

DEMO_MODEL, DEMO_DATA = str(REPO / "assets/demo/model"), str(REPO / "assets/demo/train.jsonl")
IMPORTED = (f"NPROC_PER_NODE=1 swift sft --model {DEMO_MODEL} --dataset {DEMO_DATA} "
            "--train_type lora --lora_rank 4 --learning_rate 3e-4 --max_length 128 --max_steps 6 --bogus_flag 1")


@contextmanager
def served(root):
    server = start_studio(root)
    yield server
    server.stop()


@contextmanager
def browser_page(url: str):
    with sync_playwright() as p:
        browser = launch_browser(p)
        yield open_studio(browser, url)
        browser.close()


@pytest.fixture(scope="module")
def studio(tmp_path_factory):
    with served(tmp_path_factory.mktemp("studio")) as server:
        yield server


@pytest.fixture
def page(studio):
    with browser_page(studio.url) as page:
        yield page


@pytest.fixture
def own_studio(tmp_path):
    """A studio of the test's own, for a test that changes what the studio keeps (its node
    inventory, its settings): the module's studio must show the other tests this machine."""
    with served(tmp_path / "own") as server:
        yield server


@pytest.fixture
def own_page(own_studio):
    with browser_page(own_studio.url) as page:
        yield page


def field(page, name: str):
    return page.locator(f"#f-{name}")


def test_train_form_live_checks_import_presets(studio, page):
    shot = Shots("train")
    page.get_by_role("tab", name="Train").click()
    shot(page, "opened")

    # The demo's data as training reads it: its first record through the chat template, the
    # answer (with the name the job gives the model) marked as what carries loss, the counts and
    # the lengths against max_length.
    page.get_by_text("Data preview").click()
    page.locator("#data-preview-go").click()
    expect(page.locator("#data-preview pre.preview-sample").first).to_contain_text("<|im_start|>user\nWho are you?",
                                                                                  timeout=60000)
    expect(page.locator("#data-preview pre.preview-sample mark.loss").first).to_have_text(
        "I am Swifty, an assistant trained by swift-studio.<|im_end|>")
    expect(page.locator("#data-preview")).to_contain_text("self_cognition.jsonl: 500 records; of the first 500: 0 "
                                                          "longer than max_length 64")
    # Gradio fetches plotly.js the first time a plot shows: seconds on a loaded 2-core runner.
    expect(page.locator("#data-preview-lengths .js-plotly-plot")).to_be_visible(timeout=60000)
    shot(page, "data-preview")
    # the layout advisor takes the previewed data's mean length
    page.get_by_text("Layout advisor").click()
    page.locator("#advise-go").click()
    expect(page.locator("#advice")).to_contain_text("tokens on average (the data preview's)", timeout=60000)

    # Import an ms-swift command: the form fills, the unknown flag is reported.
    page.get_by_text("Import ms-swift command").click()
    page.locator("#import-text textarea").fill(IMPORTED)
    page.locator("#import-button").click()
    expect(page.locator("#form-message")).to_contain_text("bogus_flag", timeout=15000)
    expect(field(page, "model").locator("textarea, input")).to_have_value(DEMO_MODEL)
    expect(field(page, "learning_rate").locator("input")).to_have_value("0.0003")
    expect(page.locator("#train-commands")).to_contain_text("torch.distributed.run", timeout=15000)
    expect(page.locator("#train-commands")).to_contain_text("swift sft")
    expect(page.locator("#train-layout")).to_contain_text("world")
    expect(page.locator("#train-memory")).to_contain_text("Memory per GPU")
    shot(page, "imported")

    # More ranks than the node's CPU cores is refused; TP=0 is rejected by the spec itself.
    field(page, "nproc_per_node").locator("input").fill(str(usable_cores() + 1))
    expect(field(page, "nproc_per_node")).to_have_class(re.compile("field-error"), timeout=15000)
    expect(field(page, "nproc_per_node")).to_contain_text("CPU cores")
    # One rank has nothing to split: the parallel dimensions are greyed out with the reason.
    field(page, "nproc_per_node").locator("input").fill("1")
    tp, sp = field(page, "tensor_model_parallel_size"), field(page, "sequence_parallel_size")
    expect(tp.locator("input")).to_be_disabled(timeout=15000)
    expect(tp).to_contain_text("nothing to split")
    shot(page, "one-rank-greyed")
    field(page, "nproc_per_node").locator("input").fill("2")
    expect(tp.locator("input")).to_be_enabled(timeout=15000)
    # Ulysses needs DeepSpeed and expert parallel FSDP2: neither is greyed for that, the form offers it.
    expect(sp.locator("input")).to_be_enabled()
    expect(field(page, "expert_model_parallel_size").locator("input")).to_be_enabled()
    expect(field(page, "pipeline_model_parallel_size").locator("input")).to_be_enabled()
    tp.locator("input").fill("0")
    expect(tp).to_contain_text("greater than or equal to 1", timeout=15000)
    shot(page, "invalid-layout")
    tp.locator("input").fill("1")
    expect(tp).not_to_have_class(re.compile("field-error"), timeout=15000)
    expect(field(page, "nproc_per_node")).not_to_have_class(re.compile("field-error"))
    expect(page.locator("#train-commands")).to_contain_text("torch.distributed.run")

    # SP=2 without DeepSpeed: refused with the one remedy as a button, which sets it (and says why).
    expect(page.locator("#fix-0")).to_be_hidden()
    sp.locator("input").fill("2")
    deepspeed = field(page, "deepspeed")
    expect(deepspeed).to_have_class(re.compile("field-error"), timeout=15000)
    expect(page.locator("#fix-0")).to_have_text("Fix: set deepspeed zero0")
    shot(page, "fix-offered")
    page.locator("#fix-0").click()
    expect(page.locator("#form-message")).to_contain_text("Set deepspeed zero0: sequence_parallel_size > 1 runs on "
                                                          "DeepSpeed's Ulysses", timeout=15000)
    expect(deepspeed).not_to_have_class(re.compile("field-error"))
    expect(page.locator("#fix-0")).to_be_hidden()
    expect(sp.locator("input")).to_have_value("2")
    page.get_by_role("tab", name="YAML").click()
    expect(page.locator("#train-yaml")).to_contain_text("deepspeed: zero0")
    expect(page.locator("#train-yaml")).to_contain_text("sequence_parallel_size: 2")
    page.get_by_role("tab", name="Commands").click()
    shot(page, "fix-applied")

    # Preference training: DPO is a swift rlhf line; Ulysses SP (set just above) composes with it.
    page.get_by_text("Preference training (DPO, CPO, SimPO, ORPO)").click()
    expect(field(page, "beta")).to_be_hidden()  # DPO's settings show for a DPO job only
    field(page, "rlhf_type").locator("input").click()
    page.get_by_role("option", name="dpo", exact=True).click()
    # the demo's records are no pairs, named by file:line (the form has been checked as a DPO job)
    expect(field(page, "dataset")).to_contain_text("not a preference pair", timeout=15000)
    expect(sp).not_to_have_class(re.compile("field-error"))
    expect(field(page, "beta")).to_contain_text("empty: ms-swift's default for the algorithm")
    shot(page, "dpo-with-sp")
    sp.locator("input").fill("1")
    expect(sp).not_to_have_class(re.compile("field-error"), timeout=15000)
    # a file of pairs is taken
    field(page, "dataset").locator("textarea").fill(preference_pairs(studio.root / "pairs.jsonl", 8))
    expect(field(page, "dataset")).not_to_have_class(re.compile("field-error"), timeout=15000)
    expect(page.locator("#train-commands")).to_contain_text("swift rlhf", timeout=15000)
    expect(page.locator("#train-commands")).to_contain_text("--rlhf_type dpo")
    shot(page, "dpo")

    # Save a preset, change the form, load the preset back.
    page.locator("#save-name textarea").fill("mine")
    page.locator("#save-preset").click()
    expect(page.locator("#form-message")).to_contain_text("Saved preset", timeout=15000)
    assert (studio.root / "data" / "swift-studio" / "presets" / "mine.yaml").is_file()
    field(page, "learning_rate").locator("input").fill("0.01")
    page.locator("#preset-name input").fill("mine")
    page.get_by_role("option", name="mine").click()
    page.locator("#load-preset").click()
    expect(page.locator("#form-message")).to_contain_text("Loaded preset", timeout=15000)
    expect(field(page, "learning_rate").locator("input")).to_have_value("0.0003")
    shot(page, "preset-loaded")

    # The layout advisor: its rows are predictions; one click applies the first to the form.
    page.locator("#advise-go").click()
    # the preview above measured the demo's data, not this preset's pairs: its lengths are not used
    expect(page.locator("#advice")).to_contain_text("preview the data for its own lengths", timeout=60000)
    expect(page.locator("#advice")).to_contain_text("predictions of the cost model, not measurements")
    expect(page.locator("#advice-pick")).to_contain_text("1. ")
    shot(page, "advisor")
    # a form edited since the suggestion is not given its rows (they kept the old form's batch)
    field(page, "learning_rate").locator("input").fill("0.0004")
    page.locator("#advice-apply").click()
    expect(page.locator("#form-message")).to_contain_text("Nothing applied: the form changed", timeout=15000)
    page.locator("#advise-go").click()
    expect(page.locator("#advice-pick")).to_contain_text("1. ", timeout=60000)
    page.locator("#advice-apply").click()
    expect(page.locator("#form-message")).to_contain_text("Applied layout 1. ", timeout=15000)
    expect(page.locator("#form-message")).to_contain_text("Its speed and memory are predictions")
    expect(page.locator("#train-commands")).to_contain_text("torch.distributed.run", timeout=15000)

    assert "Traceback" not in page.content()
    assert foreign_requests(page.requests, studio.url) == []


def paste(page, locator, text: str) -> None:
    """A real paste: the text on the system clipboard, then Ctrl+V into the focused, selected box."""
    page.evaluate("(text) => navigator.clipboard.writeText(text)", text)
    locator.click()
    page.keyboard.press("Control+A")
    page.keyboard.press("Control+V")


def test_pasted_values_are_checked_and_a_refused_launch_links_to_its_fields(studio, page):
    shot = Shots("paste")
    page.context.grant_permissions(["clipboard-read", "clipboard-write"], origin=studio.url.rstrip("/"))
    model = field(page, "model").locator("textarea, input")
    missing = "/nonexistent/pasted-model"
    paste(page, model, missing)
    expect(model).to_have_value(missing)
    # The pasted path is checked like a typed one: marked, listed, and the previews follow it.
    expect(field(page, "model")).to_have_class(re.compile("field-error"), timeout=15000)
    expect(field(page, "model")).to_contain_text(f"directory not found: {missing}")
    expect(page.locator("#train-problems a[href='#f-model']")).to_be_visible()
    page.get_by_role("tab", name="YAML").click()
    expect(page.locator("#train-yaml")).to_contain_text(missing)
    shot(page, "pasted-missing-model")

    # An error in a collapsed group: the fill opens the group, so its mark can be seen.
    page.get_by_text("Import ms-swift command").click()
    page.locator("#import-text textarea").fill(IMPORTED.replace(DEMO_MODEL, missing) + " --attn_impl bogus")
    page.locator("#import-button").click()
    expect(field(page, "attn_impl")).to_have_class(re.compile("field-error"), timeout=15000)
    expect(field(page, "attn_impl")).to_be_visible()
    page.get_by_text("Advanced", exact=True).click()  # the user folds it away again
    expect(field(page, "attn_impl")).to_be_hidden()

    # Launch refuses, at the button, naming each field with a link to it; the group opens again.
    page.evaluate("window.scrollTo(0, 0)")
    page.locator("#launch").click()
    status = page.locator("#launch-status")
    expect(status).to_contain_text("Not launched: fix these 2 problems first", timeout=15000)
    expect(status.locator("a")).to_have_count(2)
    expect(field(page, "attn_impl")).to_be_visible()
    shot(page, "launch-refused", full_page=False)
    status.locator("a[href='#f-attn_impl']").click()
    expect(field(page, "attn_impl")).to_be_in_viewport()
    shot(page, "followed-link-to-attn_impl", full_page=False)
    status.locator("a[href='#f-model']").scroll_into_view_if_needed()
    status.locator("a[href='#f-model']").click()
    expect(field(page, "model")).to_be_in_viewport()

    # Pasting the right path clears the mark and the launch list is no longer the form's state.
    paste(page, model, DEMO_MODEL)
    expect(field(page, "model")).not_to_have_class(re.compile("field-error"), timeout=15000)
    expect(page.locator("#train-problems a[href='#f-model']")).to_have_count(0)
    expect(page.locator("#train-yaml")).to_contain_text(f"model: {DEMO_MODEL}")
    # The refusal follows the form: it now names the one problem left, not the two it was about.
    expect(status).to_contain_text("Not launched: fix this problem first", timeout=15000)
    expect(status.locator("a")).to_have_count(1)
    shot(page, "pasted-demo-model")
    assert "Traceback" not in page.content()


def test_cluster_tab_hostfile_errors_and_nodes(own_studio, own_page):
    studio, page = own_studio, own_page
    shot = Shots("cluster")
    page.get_by_role("tab", name="Cluster").click()
    expect(page.locator("#cluster-summary")).to_contain_text("this machine", timeout=15000)
    # Pre-flight of this machine for the demo job: a check × node grid with a verdict.
    page.locator("#cluster-preflight").click()
    expect(page.locator("#preflight-grid")).to_contain_text("Pre-flight:", timeout=90000)
    expect(page.locator("#preflight-grid")).to_contain_text("localhost")
    assert page.locator("#preflight-grid td[data-status='ok']").count() >= 3
    shot(page, "preflight")
    page.get_by_text("Hostfile", exact=True).click()
    # The accordion's textarea mounts with the inventory's hostfile; typing before it has would be
    # overwritten (seen on CI: the valid local hostfile was applied).
    hostfile = page.locator("#cluster-hostfile textarea")
    expect(hostfile).to_have_value(re.compile(r"^localhost slots="), timeout=15000)
    hostfile.fill("gpu1 slots=eight\ngpu2 slots=8 colour=blue\n")
    expect(hostfile).to_have_value("gpu1 slots=eight\ngpu2 slots=8 colour=blue\n")
    page.get_by_role("button", name="Use this hostfile").click()
    expect(page.locator("#cluster-message")).to_contain_text("hostfile:1", timeout=15000)
    expect(page.locator("#cluster-message")).to_contain_text("unknown key 'colour'")
    shot(page, "hostfile-errors")
    # Pre-flight of a job on fewer nodes than the cluster has: the nodes it leaves out are shown, and why.
    # (Loopback addresses where nothing answers SSH: the checked node fails at once.)
    page.locator("#cluster-hostfile textarea").fill("127.0.0.9 slots=2 device=cpu\n127.0.0.10 slots=2 device=cpu\n")
    page.get_by_role("button", name="Use this hostfile").click()
    expect(page.locator("#cluster-summary")).to_contain_text("2 node(s)", timeout=15000)
    page.locator("#cluster-preflight").click()
    grid = page.locator("#preflight-grid")
    expect(grid).to_contain_text("127.0.0.10", timeout=90000)
    expect(grid).to_contain_text("not checked: the job (nnodes: 1) runs on the first 1")
    expect(grid.locator("td[data-status='skipped']").first).to_be_visible()
    shot(page, "preflight-left-out")
    page.locator("#cluster-hostfile textarea").fill("gpu1 slots=8 addr=10.0.0.1\ngpu2 slots=8 addr=10.0.0.2\n")
    page.get_by_role("button", name="Use this hostfile").click()
    expect(page.locator("#cluster-summary")).to_contain_text("2 node(s) · 16 GPUs", timeout=15000)
    expect(page.locator("#cluster-nodes")).to_contain_text("10.0.0.2")
    # A node's setup line is set in the node form and kept in the node inventory with the node.
    page.get_by_text("Add or change a node (SSH)").click()
    page.get_by_label("Host · host").fill("gpu2")
    page.get_by_label("GPUs · slots").fill("8")
    page.get_by_label("Address · addr").fill("10.0.0.2")
    page.locator("#cluster-setup textarea").fill("source /opt/venv/bin/activate")
    page.get_by_role("button", name="Add / update node").click()
    expect(page.locator("#cluster-message")).to_contain_text("Node gpu2 saved.", timeout=15000)
    expect(page.locator("#cluster-nodes")).to_contain_text("source /opt/venv/bin/activate")
    shot(page, "two-nodes")
    # The Train tab's layout follows the cluster.
    page.get_by_role("tab", name="Train").click()
    field(page, "model").locator("textarea, input").fill(DEMO_MODEL)
    field(page, "dataset").locator("textarea").fill(DEMO_DATA)
    field(page, "nnodes").locator("input").fill("2")
    field(page, "nproc_per_node").locator("input").fill("0")  # not set: every slot of each node
    expect(page.locator("#train-layout")).to_contain_text(re.compile(r"2 × 8\s+16\s+16\s"), timeout=15000)
    expect(page.locator("#train-commands")).to_contain_text("--rdzv_endpoint 10.0.0.1:29500")
    shot(page, "layout-on-two-nodes")
    # The price of a GPU-hour is kept for the runs' cost, also across a reload.
    page.get_by_role("tab", name="Cluster").click()
    page.locator("#cluster-price input").fill("2.5")
    page.locator("#cluster-price input").press("Enter")
    settings = studio.root / "data" / "swift-studio" / "settings.json"
    until(lambda: settings.is_file() and '"price_per_gpu_hour": 2.5' in settings.read_text(), timeout=15)
    reload_studio(page)
    page.get_by_role("tab", name="Cluster").click()
    expect(page.locator("#cluster-price input")).to_have_value("2.5", timeout=15000)
    expect(page.locator("#cluster-summary")).to_contain_text("2 node(s) · 16 GPUs", timeout=15000)
    expect(page.locator("#cluster-nodes")).to_contain_text("source /opt/venv/bin/activate")
    assert "Traceback" not in page.content()
    assert foreign_requests(page.requests, studio.url) == []
