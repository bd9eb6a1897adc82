"""``privlm bench sap --service``: what HTTP costs SAP, over loopback, against the same run in one process.

The vendor runs as its own process (``privlm sap vendor``, sessions in a scratch store); the customers are
:class:`privlm.sap.Client` objects in this process, one thread each. Measured:
  - **step latency**: the wall time of one training step at the customer (``Customer.train_step``: the forward
    message, the vendor's answer, the loss and its gradient, the gradient message, the vendor's answer), in one
    process (``InProcessTransport``, which still encodes every message to bytes) and over HTTP;
  - **bytes per step**: the payload of a training step, both ways (the same in both: the messages are the same);
  - **overhead per step**: HTTP's step latency minus the in-process one (median against median);
  - **throughput**: training steps per second over all sessions, with 1, 4 and 8 customers training at once,
    each in its own session, from one process on the same machine (so they share its cores with the vendor).

The first ``warmup`` steps of every session are left out of the latencies. Defaults: MiniLM, a frozen embedding
bottom, eta 60, the head at the customer, batch 32, 24 steps per session.
"""

from __future__ import annotations

import json
import statistics
import tempfile
import threading
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
from rich.console import Console
from rich.table import Table

from privlm.provenance import provenance
from privlm.sap import Client, SapConfig, connect, split_pretrained
from privlm.sap.customer import Customer
from privlm.service.process import free_port, start_privlm, stop
from privlm.validation import check_positive_finite, check_positive_int
from privlm_bench.data import load_tweets
from privlm_bench.harness.report import markdown_table

NAME = "sap-service"


@dataclass(frozen=True, kw_only=True)
class ServiceBenchSetting:
    model: str = "minilm"
    eta: float = 60.0
    batch_size: int = 32
    steps: int = 24
    warmup: int = 2
    sessions: tuple[int, ...] = (1, 4, 8)
    seed: int = 0

    def __post_init__(self) -> None:
        for name in ("batch_size", "steps"):
            check_positive_int(name, getattr(self, name))
        check_positive_finite("eta", self.eta)
        if isinstance(self.seed, bool) or not isinstance(self.seed, int) or self.seed < 0:
            raise ValueError(f"seed must be a non-negative integer, got {self.seed!r}")
        if not 0 <= self.warmup < self.steps:
            raise ValueError(f"warmup must be in [0, steps={self.steps}), got {self.warmup}")
        if not self.sessions or any(isinstance(n, bool) or not isinstance(n, int) or n < 1 for n in self.sessions):
            raise ValueError(f"sessions must be positive integers, got {self.sessions!r}")

    @classmethod
    def quick(cls, **change: Any) -> ServiceBenchSetting:
        settings: dict[str, Any] = {"steps": 4, "warmup": 1, "batch_size": 8, "sessions": (1, 2)}
        return cls(**(settings | change))

    def config(self) -> SapConfig:
        return SapConfig(blocks=0, eta=self.eta, head="customer", batch_size=self.batch_size, epochs=1,
                         seed=self.seed, noise_seed=self.seed)


def _timed_steps(customer: Customer, texts: Sequence[str], labels: np.ndarray, steps: int, batch_size: int
                 ) -> list[float]:
    """Upload the texts (a frozen bottom), then ``steps`` training steps; the seconds of each step."""
    tokens = customer.tokenize(texts)
    target = torch.as_tensor(labels)
    customer.upload(tokens)
    seconds = []
    for step in range(steps):
        ids = [(step * batch_size + i) % len(tokens) for i in range(batch_size)]
        start = time.perf_counter()
        customer.train_step(tokens, target, ids)
        seconds.append(time.perf_counter() - start)
    return seconds


def _summary(seconds: Sequence[float]) -> dict[str, float]:
    return {"median_ms": 1000 * statistics.median(seconds), "mean_ms": 1000 * statistics.fmean(seconds),
            "p90_ms": 1000 * float(np.percentile(seconds, 90)), "steps": len(seconds)}


class ServiceBench:
    def __init__(self, setting: ServiceBenchSetting) -> None:
        self.setting = setting
        data = load_tweets(limit=setting.batch_size * 4, seed=setting.seed)
        self.texts, self.labels = list(data.texts), np.asarray(data.labels)

    def in_process(self) -> dict[str, Any]:
        s = self.setting
        config = s.config()
        parties = connect(split_pretrained(s.model, config=config, n_classes=3), config=config, n_classes=3)
        seconds = _timed_steps(parties.customer, self.texts, self.labels, s.steps, s.batch_size)
        traffic = parties.transport.traffic
        return {"latency": _summary(seconds[s.warmup:]),
                "bytes_per_step": traffic.bytes_for("training") / s.steps,
                "upload_bytes": traffic.bytes_for("upload")}

    def _client(self, url: str, cache: Path) -> Client:
        return Client(url, config=self.setting.config(), n_classes=3, cache_dir=cache)

    def over_http(self, url: str, cache: Path) -> dict[str, Any]:
        s = self.setting
        with self._client(url, cache) as client:
            seconds = _timed_steps(client.customer, self.texts, self.labels, s.steps, s.batch_size)
            traffic = client.transport.traffic
            client.delete()
        return {"latency": _summary(seconds[s.warmup:]), "bytes_per_step": traffic.bytes_for("training") / s.steps,
                "upload_bytes": traffic.bytes_for("upload")}

    def throughput(self, url: str, cache: Path, sessions: int) -> dict[str, Any]:
        """``sessions`` customers at once, each uploading then training ``steps`` steps in its own session."""
        s = self.setting
        clients = [self._client(url, cache) for _ in range(sessions)]
        for client in clients:
            client.customer.upload(client.customer.tokenize(self.texts))
        tokens = [client.customer.tokenize(self.texts) for client in clients]
        target = torch.as_tensor(self.labels)
        step_seconds: list[list[float]] = [[] for _ in clients]
        errors: list[BaseException] = []
        barrier = threading.Barrier(sessions)

        def train(index: int) -> None:
            try:
                barrier.wait()
                for step in range(s.steps):
                    ids = [(step * s.batch_size + i) % len(self.texts) for i in range(s.batch_size)]
                    start = time.perf_counter()
                    clients[index].customer.train_step(tokens[index], target, ids)
                    step_seconds[index].append(time.perf_counter() - start)
            except BaseException as error:  # reported below, not lost in the thread
                errors.append(error)

        threads = [threading.Thread(target=train, args=(i,)) for i in range(sessions)]
        start = time.perf_counter()
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()
        wall = time.perf_counter() - start
        for client in clients:
            client.delete()
            client.close()
        if errors:
            raise errors[0]
        latencies = [x for seconds in step_seconds for x in seconds[s.warmup:]]
        return {"sessions": sessions, "steps": sessions * s.steps, "wall_seconds": wall,
                "steps_per_second": sessions * s.steps / wall, "latency": _summary(latencies)}


def service_markdown(payload: dict[str, Any]) -> str:
    meta, s = payload["metadata"], payload["setting"]
    local, remote = payload["in_process"], payload["http"]
    lines = [f"# `privlm bench sap --service`: {meta['description']}", "",
             f"- command: `{meta['command']}`", f"- git commit: `{meta['git_commit']}`, seed {meta['seed']}",
             f"- machine: {meta['machine']}", f"- started (UTC) {meta['started_utc']}, wall time "
             f"{meta['wall_seconds']} s",
             f"- {s['model']}, frozen embedding bottom, eta {s['eta']:g}, head at the customer, batch "
             f"{s['batch_size']}, {s['steps']} steps per session ({s['warmup']} of warm-up left out of the "
             "latencies)", "",
             "## One session", ""]
    rows: list[dict[str, object]] = [{"transport": name, "median step ms": f"{r['latency']['median_ms']:.1f}",
             "p90 step ms": f"{r['latency']['p90_ms']:.1f}", "KB per step": f"{r['bytes_per_step'] / 1e3:.1f}",
             "upload MB": f"{r['upload_bytes'] / 1e6:.2f}"} for name, r in (("in process", local), ("HTTP", remote))]
    lines += [markdown_table(rows), "", f"Overhead per step (median HTTP - median in process): "
              f"{payload['overhead_ms']:.1f} ms.", "", "## Concurrent sessions", ""]
    rows = [{"sessions": r["sessions"], "steps": r["steps"], "wall s": f"{r['wall_seconds']:.1f}",
             "steps / s": f"{r['steps_per_second']:.2f}", "median step ms": f"{r['latency']['median_ms']:.1f}"}
            for r in payload["throughput"]]
    lines += [markdown_table(rows), "",
              "The customers run in one process beside the vendor on the same cores: the figures measure the "
              "vendor's sessions sharing a machine, not a network.", ""]
    return "\n".join(lines)


def render_service_report(out_dir: Path) -> list[Path]:
    payload = json.loads((out_dir / "results.json").read_text())
    (out_dir / "results.md").write_text(service_markdown(payload))
    return [out_dir / "results.md"]




def run_service_bench(setting: ServiceBenchSetting, out_dir: Path, console: Console | None = None, *,
                      command: list[str] | None = None) -> list[Path]:
    console = console or Console()
    started = time.perf_counter()
    meta = provenance(seed=setting.seed, command=command)
    bench = ServiceBench(setting)
    with console.status("In process..."):
        local = bench.in_process()
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    with tempfile.TemporaryDirectory(prefix="privlm-sap-service-") as scratch:
        vendor = start_privlm(["sap", "vendor", "--model", setting.model, "--store", str(Path(scratch) / "store"),
                               "--port", str(port), "--device", "cpu",
                               "--max-sessions", str(max(setting.sessions) + 1)], f"{url}/health")
        try:
            with console.status("Over HTTP, one session..."):
                remote = bench.over_http(url, Path(scratch) / "cache")
            throughput = []
            for sessions in setting.sessions:
                with console.status(f"Over HTTP, {sessions} sessions at once..."):
                    throughput.append(bench.throughput(url, Path(scratch) / "cache", sessions))
        finally:
            stop(vendor)
    payload = {"metadata": {**meta, "sweep": NAME, "wall_seconds": round(time.perf_counter() - started, 1),
                            "description": f"SAP over loopback against in-process, {setting.model}"},
               "setting": asdict(setting), "in_process": local, "http": remote,
               "overhead_ms": remote["latency"]["median_ms"] - local["latency"]["median_ms"],
               "throughput": throughput}
    out_dir.mkdir(parents=True, exist_ok=True)
    (out_dir / "results.json").write_text(json.dumps(payload, indent=2) + "\n")
    files = [out_dir / "results.json", *render_service_report(out_dir)]
    table = Table("", "median step ms", "KB per step", title="privlm bench sap --service")
    for name, r in (("in process", local), ("HTTP", remote)):
        table.add_row(name, f"{r['latency']['median_ms']:.1f}", f"{r['bytes_per_step'] / 1e3:.1f}")
    console.print(table)
    for r in throughput:
        console.print(f"{r['sessions']} session(s): {r['steps_per_second']:.2f} steps/s")
    return files
