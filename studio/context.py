"""What every tab's handlers share: where presets live, the default output directory and the
backend facade. One per studio process."""
from __future__ import annotations

import json
import logging
import os
import re
import threading
from concurrent.futures import Future
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import yaml

from backend.job.cluster import Cluster, HostfileError, cluster_from_dicts, local_cluster
from backend.job.spec import JobSpec, Problem, parse_spec

log = logging.getLogger(__name__)
PRESET_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,63}$")
MANAGER_WAIT_S = 30  # for the run manager at the page build: it starts beside the (slower) Gradio import
_SETTINGS_WRITE = threading.Lock()  # settings.json: one read-modify-write at a time in this process


@dataclass
class Studio:
    data_dir: Path
    output_dir: Path
    manager_future: Future = field(default_factory=Future)
    """Resolves to the backend.runs.manager.RunManager; it is built while the page already answers."""

    @property
    def manager(self) -> Any:
        return self.manager_future.result()

    @property
    def presets_dir(self) -> Path:
        return self.data_dir / "presets"

    @property
    def cluster_file(self) -> Path:
        """Where studios before the node inventory kept the cluster; read once into the inventory."""
        return self.data_dir / "cluster.json"

    def load_cluster(self, wait: bool = True) -> tuple[Cluster, dict[str, str]]:
        """`read_inventory`, or this machine where the inventory cannot be read (logged). Without
        `wait`, this machine while the run manager (which holds the inventory) is still starting."""
        if not wait and not self.manager_future.done():
            return local_cluster(), {}
        try:
            return self.read_inventory()
        except Exception as exc:  # noqa: BLE001 - the page still works on this machine
            log.warning("the node inventory is not readable (%s); showing this machine", exc)
            return local_cluster(), {}

    def read_inventory(self) -> tuple[Cluster, dict[str, str]]:
        """The node inventory (the cluster last used, so a restart keeps it) and its setup lines,
        else this machine. The local node's GPUs are probed again; its slot count is kept. Raises
        where it cannot be read (the run manager did not start, the database is locked)."""
        manager = self.manager_future.result(timeout=MANAGER_WAIT_S)
        found = manager.node_inventory()
        if found is None and self._import_cluster_file(manager):
            found = manager.node_inventory()
        local = local_cluster()
        if found is None:
            return local, {}
        stored, setups = found
        here = local.nodes[0]
        nodes = tuple(replace(here, slots=n.slots) if n.local else n for n in stored.nodes)
        return Cluster(nodes=nodes, source=stored.source), setups

    def _import_cluster_file(self, manager) -> bool:
        """An older studio's cluster.json into the inventory, in its order, with the setup lines
        stored for its hosts (the file is left as it is); whether there was one to read."""
        try:
            stored = cluster_from_dicts(json.loads(self.cluster_file.read_text()), source=str(self.cluster_file))
        except FileNotFoundError:
            return False
        except (OSError, ValueError, HostfileError) as exc:
            log.warning("ignoring %s: %s", self.cluster_file, exc)
            return False
        manager.set_inventory(stored)
        return True

    def save_cluster(self, cluster: Cluster, setups: dict[str, str] | None = None) -> dict[str, str]:
        """The cluster as the node inventory (`setups`: lines to set, "" clears one); returns every
        stored setup line."""
        self.manager.set_inventory(cluster, setups)
        found = self.manager.node_inventory()
        return found[1] if found else {}

    @property
    def settings_file(self) -> Path:
        return self.data_dir / "settings.json"

    def _settings(self) -> dict[str, Any]:
        try:
            data = json.loads(self.settings_file.read_text())
        except (OSError, ValueError):
            return {}
        return data if isinstance(data, dict) else {}

    def _save_setting(self, key: str, value: Any) -> None:
        """One setting changed, the others kept (written whole, through a file of this process;
        Gradio runs two handlers at once on threads of one process, which take turns here)."""
        with _SETTINGS_WRITE:
            self.data_dir.mkdir(parents=True, exist_ok=True)
            tmp = self.settings_file.with_suffix(f".{os.getpid()}.tmp")
            tmp.write_text(json.dumps(self._settings() | {key: value}))
            tmp.replace(self.settings_file)

    def gpu_hour_price(self) -> float | None:
        """The price of one GPU-hour the user gave in the Cluster tab (any currency), else None."""
        value = self._settings().get("price_per_gpu_hour")
        return float(value) if isinstance(value, (int, float)) and value > 0 else None

    def save_gpu_hour_price(self, price: float | None) -> None:
        self._save_setting("price_per_gpu_hour", price if price and price > 0 else None)

    def slurm_settings(self) -> dict[str, Any] | None:
        """The Slurm partition the Cluster tab targets (its fields, `studio.cluster_view.SLURM_KEYS`),
        else None: the SSH nodes."""
        from studio.cluster_view import slurm_settings

        value = self._settings().get("slurm")
        return slurm_settings(value) if isinstance(value, dict) else None

    def save_slurm_settings(self, settings: dict[str, Any] | None) -> None:
        self._save_setting("slurm", settings)

    def preset_names(self) -> list[str]:
        saved = sorted(p.stem for p in self.presets_dir.glob("*.yaml")) if self.presets_dir.is_dir() else []
        return ["demo", *[n for n in saved if n != "demo"]]

    def load_preset(self, name: str) -> tuple[dict[str, Any] | None, list[Problem]]:
        """A preset as a spec mapping. 'demo' is the bundled tiny model and dataset."""
        if name == "demo":
            from backend.job.demo import demo_spec
            spec = demo_spec(output_dir=str(self.output_dir))
            return spec.model_dump(), []
        path = self.presets_dir / f"{name}.yaml"
        try:
            data = yaml.safe_load(path.read_text())
        except FileNotFoundError:
            return None, [Problem(name, f"no preset named {name!r} in {self.presets_dir}")]
        except (OSError, yaml.YAMLError) as exc:
            return None, [Problem(str(path), f"cannot read preset: {exc}")]
        spec, problems = parse_spec(data, source=str(path))
        return (spec.model_dump() if spec else None), problems

    def save_preset(self, name: str, spec: JobSpec) -> Path:
        """Writes the preset YAML; raises ValueError with a user-facing message for a bad name."""
        name = (name or "").strip()
        if name == "demo":
            raise ValueError("'demo' is the bundled preset; pick another name")
        if not PRESET_NAME.match(name):
            raise ValueError("preset name: use letters, digits, '.', '_' or '-' (up to 64), starting with a letter or digit")
        self.presets_dir.mkdir(parents=True, exist_ok=True)
        path = self.presets_dir / f"{name}.yaml"
        path.write_text(spec.to_yaml())
        return path
