"""``privlm bench serve --gateway-replicas 1,2``: the gateway on Ray Serve with N replicas sharing one PostgreSQL
ledger, and what the ledger itself adds to a request.

One run, every party in its own process on localhost: a PostgreSQL server (privlm.accounting.postgres_server:
the bench runs from a checkout), the chat
bench's stub upstream (answers at once, so that the gateway's own work stands alone), a ``privlm serve`` SnD
server; then, for each N, ``privlm gateway --ray --replicas N`` (chat: Cape on SmolLM2 at the chat bench's
epsilon with B calibrated as it does, conversation memory off so that every request is perturbed; embeddings:
SnD at the serve bench's eta; both ledgers in databases of their own on that server, budgets no run can reach,
so every request is checked and charged and none refused). Per N, endpoint (chat, embeddings) and number of
clients c, with R requests per client after a warm-up that reaches every replica:

    throughput = answered requests / wall time of the whole row        (embeddings: x 8 sentences a request)
    p50, p99   = percentiles of the per-request latency (until the whole answer was read)

and the distinct ``x-privlm-replica`` headers of the row's answers (its warm-up included): how many replicas served.

The ledger's added latency, two ways:
  - in process: ``Ledger.spend_all`` of one small spend, ``calls`` times in turn, then ``calls`` times spread over
    ``threads`` threads (one principal: every call waits for the same row), on a SQLite file and on PostgreSQL;
    added = percentile(PostgreSQL) - percentile(SQLite);
  - end to end: the one-replica gateway with both ledgers on SQLite against the one with both on PostgreSQL,
    chat at :data:`LEDGER_CLIENTS` clients; added = p50(PostgreSQL) - p50(SQLite). One run of each: it carries the
    run-to-run variation of the gateway's latency too.

Every process shares the machine's cores; on a machine whose cores one replica already fills, more replicas cannot
be faster. The seed fixes the prompts' and the texts' order; the perturbations draw from OS entropy (the gateway's).
"""

from __future__ import annotations

import asyncio
import json
import os
import sqlite3
import subprocess
import tempfile
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from contextlib import ExitStack, contextmanager
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import httpx
import psutil

from privlm.accounting import Ledger
from privlm.accounting.database import close_pools, is_database_url
from privlm.accounting.postgres_server import PostgresServer
from privlm.mechanisms import PrivacyUnit, Spend
from privlm.provenance import provenance
from privlm.service.process import free_port, start_privlm, stop
from privlm.validation import check_positive_finite, check_positive_int
from privlm_bench.chat.load import (
    PROMPTS,
    STUB_MODEL,
    ChatBenchSetting,
    LoadResult,
    Timing,
    calibrate_bound,
    chat_body,
    child_env,
    complete,
    gateway_args,
    prompt_order,
    run_load,
    start_stub,
    summarize,
)
from privlm_bench.data import named_task, split_dataset
from privlm_bench.snd.serve_load import GATEWAY_ETA, SENTENCES_PER_REQUEST, _load_gateway, start_server

REPLICA_HEADER = "x-privlm-replica"  # privlm.gateway.ray's; not imported, so that the report needs no Ray
CLIENT_COUNTS = (8, 32)
REPLICA_REQUESTS_PER_CLIENT = 8  # per client and row: the default run takes about 10 min on 2 cores
LEDGER_CLIENTS = 8  # the end-to-end comparison's load
NEVER_REFUSED = 1e15  # a budget no run reaches: every request is checked and charged, none refused
LEDGER_SPEND = Spend(PrivacyUnit.EPSILON, 1.0)
GATEWAY_START_S = 900.0  # Ray, then every replica loading SmolLM2 and MiniLM on a busy 2-core machine
CHAT, EMBEDDINGS = "chat", "embeddings"
POSTGRESQL, SQLITE = "postgresql", "sqlite"


def parse_replica_counts(text: str) -> tuple[int, ...]:
    """``"1,2"`` -> ``(1, 2)``: comma-separated positive integers, each once."""
    parts = [part.strip() for part in text.split(",")]
    if not text.strip() or not all(part.isdigit() and int(part) > 0 for part in parts):
        raise ValueError(f"give comma-separated positive integers (e.g. 1,2), got {text!r}")
    counts = tuple(int(part) for part in parts)
    if len(set(counts)) != len(counts):
        raise ValueError(f"each number of replicas once, got {text!r}")
    return counts


@dataclass(kw_only=True)
class ReplicaBenchSetting:
    """One run's sizes: ``replicas``, the gateways' numbers of replicas; ``clients``, the loads; ``ledger_calls``
    and ``ledger_threads``, the in-process ledger timing's; ``replica_cpus``: Ray's reservation per replica (None:
    the machine's cores shared out, :meth:`cpus_per_replica`)."""

    replicas: tuple[int, ...] = (1, 2)
    clients: tuple[int, ...] = CLIENT_COUNTS
    requests_per_client: int = REPLICA_REQUESTS_PER_CLIENT
    ledger_calls: int = 200
    ledger_threads: int = 8
    replica_cpus: float | None = None
    model: str = "minilm"
    seed: int = 0

    def __post_init__(self) -> None:
        if not self.replicas or not self.clients:
            raise ValueError("replicas and clients must each name at least one number")
        for count in (*self.replicas, *self.clients):
            check_positive_int("replicas and clients", count)
        self.replicas, self.clients = tuple(self.replicas), tuple(self.clients)
        check_positive_int("requests_per_client", self.requests_per_client)
        check_positive_int("ledger_calls", self.ledger_calls)
        check_positive_int("ledger_threads", self.ledger_threads)
        if self.replica_cpus is not None:
            check_positive_finite("replica_cpus", self.replica_cpus)

    def cpus_per_replica(self, replicas: int) -> float:
        """Ray's reservation for each of ``replicas`` replicas: ``replica_cpus``, else the machine's cores shared
        out, as a deployment on one machine would (a replica's torch then runs on that many threads, at least one:
        Ray sets OMP_NUM_THREADS to an actor's whole CPUs when it is not set)."""
        return self.replica_cpus or (os.cpu_count() or 1) / replicas

    @property
    def chat(self) -> ChatBenchSetting:
        """The chat bench's setting these gateways share (epsilon, warm-up, max_tokens, the stub's chunks)."""
        return ChatBenchSetting(requests_per_client=self.requests_per_client, clients=self.clients, seed=self.seed,
                                skip_llm=True, int8=False)


# ---------------------------------------------------------------------------------------------- the ledger alone


def create_database(server_url: str, name: str) -> str:
    """A new database ``name`` on the PostgreSQL server of ``server_url`` (whose user may create databases); its
    URL."""
    import psycopg
    from psycopg import sql

    with psycopg.connect(server_url, autocommit=True) as admin:
        admin.execute(sql.SQL("CREATE DATABASE {}").format(sql.Identifier(name)))
    return server_url.rsplit("/", 1)[0] + "/" + name


def durability(location: str | Path) -> dict[str, str]:
    """What a commit waits for on this ledger: SQLite's ``synchronous`` (in WAL mode), PostgreSQL's ``fsync`` and
    ``synchronous_commit``; read from the database, so that the report says what was measured."""
    if is_database_url(location):
        import psycopg

        with psycopg.connect(str(location)) as db:
            return {name: str(db.execute(f"SHOW {name}").fetchone()[0])  # type: ignore[index]
                    for name in ("fsync", "synchronous_commit")}
    with sqlite3.connect(location) as db:
        level = int(db.execute("PRAGMA synchronous").fetchone()[0])
        mode = str(db.execute("PRAGMA journal_mode").fetchone()[0])
    return {"synchronous": ("OFF", "NORMAL", "FULL", "EXTRA")[level], "journal_mode": mode}


def ledger_latency(location: str | Path, *, secret: Path | None = None, calls: int, threads: int
                   ) -> dict[str, Any]:
    """``Ledger.spend_all`` of :data:`LEDGER_SPEND` for one principal: ``calls`` calls in turn, then ``calls`` calls
    over ``threads`` threads, each call timed (ms percentiles, :func:`summarize`), after one untimed call (schema,
    secret, first connection). ``charged_every_call``: the principal's total is every call's spend."""
    check_positive_int("calls", calls)
    check_positive_int("threads", threads)
    ledger = Ledger(location, budgets={LEDGER_SPEND.unit: NEVER_REFUSED}, secret=secret)
    principal = ledger.principal_of_key("privlm-bench-ledger")

    def timed(_: int = 0) -> float:
        started = time.perf_counter()
        ledger.spend_all(principal, [LEDGER_SPEND], note="bench")
        return time.perf_counter() - started

    try:
        timed()
        serial = [timed() for _ in range(calls)]
        started = time.perf_counter()
        with ThreadPoolExecutor(threads) as pool:
            concurrent = list(pool.map(timed, range(calls)))
        wall = time.perf_counter() - started
        spent = ledger.spent(principal, LEDGER_SPEND.unit)
    finally:
        if is_database_url(location):
            close_pools(str(location))
    return {"backend": POSTGRESQL if is_database_url(location) else SQLITE, "calls": calls,
            "serial": summarize(serial), "concurrent": {**summarize(concurrent), "threads": threads,
                                                        "spends_per_s": calls / wall},
            "charged_every_call": spent == (2 * calls + 1) * LEDGER_SPEND.amount,
            "durability": durability(location)}


def ledger_comparison(sqlite: Mapping[str, Any], postgresql: Mapping[str, Any]) -> dict[str, float]:
    """PostgreSQL's percentiles minus SQLite's (ms), alone and with threads."""
    return {f"{phase}_{stat}_ms": float(postgresql[phase][f"{stat}_ms"] - sqlite[phase][f"{stat}_ms"])
            for phase in ("serial", "concurrent") for stat in ("p50", "p99")}


# ------------------------------------------------------------------------------------------------- the gateways


@dataclass(frozen=True)
class GatewayRun:
    """One gateway of the run: its replicas, where both its ledgers live, and which (endpoint, clients) it is
    measured at."""

    replicas: int
    ledger: str
    rows: tuple[tuple[str, int], ...]


def plan(setting: ReplicaBenchSetting) -> list[GatewayRun]:
    """Every gateway of the run, in order: the one-replica PostgreSQL gateway, at once the SQLite one (so that the
    end-to-end comparison's two sides run back to back), then the other numbers of replicas."""
    full = tuple((endpoint, c) for c in setting.clients for endpoint in (CHAT, EMBEDDINGS))
    e2e = ((CHAT, LEDGER_CLIENTS),)
    one = GatewayRun(1, POSTGRESQL, full if 1 in setting.replicas else e2e)
    return [one, GatewayRun(1, SQLITE, e2e), *(GatewayRun(n, POSTGRESQL, full) for n in setting.replicas if n != 1)]


def replica_gateway_args(port: int, *, stub_url: str, server_url: str, replicas: int, replica_cpus: float,
                         epsilon: float, logit_bound: Path, chat_ledger: str, ledger: str, secret: Path | None,
                         max_in_flight: int) -> list[str]:
    """The chat bench's gateway (:func:`gateway_args`), on Ray with ``replicas`` replicas, SnD embeddings too, and
    both ledgers given, with budgets no run reaches."""
    return [*gateway_args(port, stub_url, epsilon=epsilon, logit_bound=logit_bound, max_in_flight=max_in_flight),
            "--chat-model", STUB_MODEL, "--ray", "--replicas", str(replicas), "--replica-cpus", f"{replica_cpus:g}",
            "--device", "cpu", "--server", server_url, "--eta", f"{GATEWAY_ETA:g}",
            "--chat-budget", f"{NEVER_REFUSED:g}", "--chat-ledger", chat_ledger,
            "--budget", f"{NEVER_REFUSED:g}", "--ledger", ledger,
            *(["--ledger-secret", str(secret), "--chat-ledger-secret", str(secret)] if secret is not None else [])]


@contextmanager
def ray_gateway(args: list[str], port: int) -> Iterator[subprocess.Popen[bytes]]:
    """``privlm ARGS`` while the block runs; stopped with time to shut Ray down (SIGTERM, then a kill)."""
    process = start_privlm(args, f"http://127.0.0.1:{port}/health", timeout=GATEWAY_START_S, env=child_env())
    try:
        yield process
    finally:
        process.terminate()
        try:
            process.wait(timeout=120)
        except subprocess.TimeoutExpired:
            stop(process)


class ReplicaTally:
    """The distinct :data:`REPLICA_HEADER` values of the answers seen since the last :meth:`take`."""

    def __init__(self) -> None:
        self.seen: set[str] = set()

    async def __call__(self, response: httpx.Response) -> None:
        if (replica := response.headers.get(REPLICA_HEADER)) is not None:
            self.seen.add(replica)

    def take(self) -> list[str]:
        seen, self.seen = sorted(self.seen), set()
        return seen


def chat_row(result: LoadResult, *, replicas: int, ledger: str, seen: Sequence[str]) -> dict[str, Any]:
    """One chat row from :func:`run_load`'s result."""
    latency = summarize([t.latency_s for t in result.timings]) if result.timings else None
    return {"endpoint": CHAT, "replicas": replicas, "ledger": ledger, "clients": result.clients,
            "requests_per_client": result.requests_per_client, "answered": len(result.timings),
            "errors": len(result.errors), "first_error": result.errors[0] if result.errors else None,
            "requests_per_s": len(result.timings) / result.wall_s if result.wall_s > 0 else 0.0,
            "sentences_per_s": None, "p50_ms": None if latency is None else latency["p50_ms"],
            "p99_ms": None if latency is None else latency["p99_ms"], "replicas_seen": len(seen)}


def embeddings_row(measured: Mapping[str, float], *, replicas: int, ledger: str, requests_per_client: int,
                   seen: Sequence[str]) -> dict[str, Any]:
    """One embeddings row from the serve bench's measurement (``_load_gateway``: it raises on a failed request)."""
    return {"endpoint": EMBEDDINGS, "replicas": replicas, "ledger": ledger, "clients": int(measured["clients"]),
            "requests_per_client": requests_per_client, "answered": int(measured["requests"]), "errors": 0,
            "first_error": None, "requests_per_s": measured["sentences_per_s"] / SENTENCES_PER_REQUEST,
            "sentences_per_s": measured["sentences_per_s"], "p50_ms": measured["p50_ms"],
            "p99_ms": measured["p99_ms"], "replicas_seen": len(seen)}


async def measure_gateway(run: GatewayRun, url: str, setting: ReplicaBenchSetting, texts: list[str],
                          log: Callable[[str], None]) -> list[dict[str, Any]]:
    """Warm ``url`` up (enough concurrent requests to reach every replica), then measure ``run.rows``."""
    chat = setting.chat
    order = prompt_order(setting.seed, len(PROMPTS))
    tally = ReplicaTally()

    async def send(http: httpx.AsyncClient, client: int, k: int) -> Timing:
        prompt = PROMPTS[order[(client * setting.requests_per_client + k) % len(PROMPTS)]]
        return await complete(http, chat_body(STUB_MODEL, prompt, max_tokens=chat.max_tokens, stream=False))

    warm_clients = 2 * run.replicas
    log(f"{run.replicas} replica(s), {run.ledger}: warm-up, {warm_clients} clients")
    warm = await run_load(url, send, clients=warm_clients, requests_per_client=max(1, chat.warmup_requests))
    if not warm.timings:
        raise RuntimeError(f"the gateway answered no chat warm-up request: {warm.errors[0]}")
    if any(endpoint == EMBEDDINGS for endpoint, _ in run.rows):
        await _load_gateway(url, texts, warm_clients, 1)
    rows = []
    for endpoint, clients in run.rows:
        log(f"{run.replicas} replica(s), {run.ledger}: {endpoint}, {clients} clients")
        tally.take()
        before = psutil.cpu_times()
        if endpoint == CHAT:
            result = await run_load(url, send, clients=clients, requests_per_client=setting.requests_per_client,
                                    on_response=tally)
            row = chat_row(result, replicas=run.replicas, ledger=run.ledger, seen=tally.take())
        else:
            measured = await _load_gateway(url, texts, clients, setting.requests_per_client, on_response=tally)
            row = embeddings_row(measured, replicas=run.replicas, ledger=run.ledger,
                                 requests_per_client=setting.requests_per_client, seen=tally.take())
        rows.append({**row, "cpu_busy": cpu_busy(before, psutil.cpu_times())})
    return rows


def cpu_busy(before: Any, after: Any) -> float:
    """The share of the machine's CPU time (every core) that was not idle between two ``psutil.cpu_times()``."""
    total = sum(after) - sum(before)
    idle = (after.idle + getattr(after, "iowait", 0.0)) - (before.idle + getattr(before, "iowait", 0.0))
    return 0.0 if total <= 0 else max(0.0, min(1.0, 1.0 - idle / total))


def _postgres_server() -> PostgresServer:
    """A durable PostgreSQL server (commits reach the disk, as SQLite's do: a fair ledger comparison)."""
    return PostgresServer(durable=True)


def run_replica_bench(setting: ReplicaBenchSetting, out_dir: Path, log: Callable[[str], None]) -> list[Path]:
    """The whole run (module docstring); writes results.json and results.md in ``out_dir``; returns them."""
    meta = provenance(seed=setting.seed)
    load_at_start = os.getloadavg()
    texts = list(split_dataset(named_task("tweets-binary"), seed=setting.seed).test.texts[:512])
    postgres = _postgres_server()
    rows: list[dict[str, Any]] = []
    commands: dict[str, list[str]] = {}
    with tempfile.TemporaryDirectory(prefix="privlm-replica-bench-") as tmp, ExitStack() as stack:
        folder = Path(tmp)
        log("starting PostgreSQL")
        admin_url = postgres.start()
        stack.callback(postgres.remove)
        secret = folder / "ledger.secret"
        log(f"ledger alone: {setting.ledger_calls} spends in turn and over {setting.ledger_threads} threads")
        ledgers = {SQLITE: ledger_latency(folder / "ledger-alone.sqlite", calls=setting.ledger_calls,
                                          threads=setting.ledger_threads),
                   POSTGRESQL: ledger_latency(create_database(admin_url, "bench_ledger_alone"), secret=secret,
                                              calls=setting.ledger_calls, threads=setting.ledger_threads)}
        log("calibrating Cape's logit bound on public prompts")
        bound = calibrate_bound(folder / "logit_bound.json")
        stub_port, server_port = free_port(), free_port()
        stub = start_stub(stub_port, setting.chat.stub_chunks)
        stack.callback(stop, stub)
        log(f"starting privlm serve ({setting.model})")
        server = start_server(server_port, setting.model)
        stack.callback(stop, server)
        for index, run in enumerate(plan(setting)):
            if run.ledger == POSTGRESQL:
                chat_ledger = create_database(admin_url, f"bench_chat_{index}")
                ledger = create_database(admin_url, f"bench_embeddings_{index}")
            else:
                chat_ledger, ledger = str(folder / f"chat-{index}.sqlite"), str(folder / f"embeddings-{index}.sqlite")
            port = free_port()
            args = replica_gateway_args(
                port, stub_url=f"http://127.0.0.1:{stub_port}", server_url=f"http://127.0.0.1:{server_port}",
                replicas=run.replicas, replica_cpus=setting.cpus_per_replica(run.replicas),
                epsilon=setting.chat.epsilon,
                logit_bound=folder / "logit_bound.json", chat_ledger=chat_ledger, ledger=ledger,
                secret=secret if run.ledger == POSTGRESQL else None,
                max_in_flight=max(32, 2 * max(setting.clients)))
            commands[f"{run.replicas} replica(s), {run.ledger}"] = ["privlm", *args]
            log(f"starting privlm gateway --ray --replicas {run.replicas} ({run.ledger} ledgers)")
            started = time.perf_counter()
            with ray_gateway(args, port):
                log(f"gateway up in {time.perf_counter() - started:.0f} s")
                measured = asyncio.run(measure_gateway(run, f"http://127.0.0.1:{port}", setting, texts, log))
                rows += [{**row, "replica_cpus": setting.cpus_per_replica(run.replicas)} for row in measured]
    payload = replica_results(setting, rows, ledgers, meta=meta, logit_bound=bound, commands=commands)
    payload["environment"]["load_average"] = {"start": list(load_at_start), "end": list(os.getloadavg())}
    return write_replica_report(out_dir, payload)


# ---------------------------------------------------------------------------------------------------- report


def end_to_end(rows: Sequence[Mapping[str, Any]]) -> dict[str, Any] | None:
    """The one-replica gateway's chat p50 at :data:`LEDGER_CLIENTS` clients on each ledger, and the difference."""
    p50 = {r["ledger"]: r["p50_ms"] for r in rows if r["endpoint"] == CHAT and r["replicas"] == 1
           and r["clients"] == LEDGER_CLIENTS and r["p50_ms"] is not None}
    if SQLITE not in p50 or POSTGRESQL not in p50:
        return None
    return {"clients": LEDGER_CLIENTS, "sqlite_p50_ms": p50[SQLITE], "postgresql_p50_ms": p50[POSTGRESQL],
            "added_p50_ms": p50[POSTGRESQL] - p50[SQLITE]}


def scaling(rows: Sequence[Mapping[str, Any]]) -> list[dict[str, Any]]:
    """Per endpoint and clients (PostgreSQL gateways): each number of replicas' throughput over the fewest's."""
    out = []
    measured = [r for r in rows if r["ledger"] == POSTGRESQL]
    for endpoint, clients in sorted({(r["endpoint"], r["clients"]) for r in measured}):
        same = {r["replicas"]: r for r in measured if r["endpoint"] == endpoint and r["clients"] == clients}
        base = min(same)
        for n in sorted(same):
            if n != base and same[base]["requests_per_s"] > 0:
                out.append({"endpoint": endpoint, "clients": clients, "replicas": n, "against_replicas": base,
                            "throughput_ratio": same[n]["requests_per_s"] / same[base]["requests_per_s"],
                            "cpu_busy": same[n].get("cpu_busy"), "against_cpu_busy": same[base].get("cpu_busy")})
    return out


def replica_results(setting: ReplicaBenchSetting, rows: Sequence[Mapping[str, Any]],
                    ledgers: Mapping[str, Mapping[str, Any]], *, meta: Mapping[str, object],
                    logit_bound: Mapping[str, Any] | None = None,
                    commands: Mapping[str, list[str]] | None = None) -> dict[str, Any]:
    """results.json's content: provenance, the setting, the environment, every row, the replicas' scaling, and the
    ledger's added latency (alone and end to end)."""
    return {
        "metadata": {**meta, "sweep": "gateway-replicas"},
        "setting": asdict(setting),
        "environment": {"cpu_count": os.cpu_count(), "omp_num_threads": os.environ.get("OMP_NUM_THREADS"),
                        "note": "PostgreSQL, the stub, the SnD server, the gateway's replicas and the clients share "
                                "this one machine"},
        "gateway": {"chat": {"mechanism": "cape", "epsilon_per_token": setting.chat.epsilon,
                             "logit_bound": logit_bound, "device_model": "smollm2", "memory": "off"},
                    "embeddings": {"eta": GATEWAY_ETA, "sentences_per_request": SENTENCES_PER_REQUEST},
                    "budgets": NEVER_REFUSED},
        "commands": dict(commands or {}),
        "rows": [dict(r) for r in rows],
        "scaling": scaling(rows),
        "ledger": {"alone": {k: dict(v) for k, v in ledgers.items()},
                   "added_alone_ms": (ledger_comparison(ledgers[SQLITE], ledgers[POSTGRESQL])
                                      if SQLITE in ledgers and POSTGRESQL in ledgers else None),
                   "end_to_end": end_to_end(rows)},
    }


def write_replica_report(out_dir: Path, payload: Mapping[str, Any]) -> list[Path]:
    out_dir.mkdir(parents=True, exist_ok=True)
    (out_dir / "results.json").write_text(json.dumps(payload, indent=2) + "\n")
    (out_dir / "results.md").write_text(replica_markdown(payload))
    return [out_dir / "results.json", out_dir / "results.md"]


def _cpus_line(payload: Mapping[str, Any]) -> str:
    """CPUs Ray reserved per replica, per number of replicas (a replica's torch runs on that many threads)."""
    per = {r["replicas"]: r.get("replica_cpus") for r in payload["rows"] if r.get("replica_cpus") is not None}
    if not per:
        return "CPUs reserved per replica not recorded"
    return "CPUs reserved per replica (its torch threads): " + ", ".join(
        f"{per[n]:g} with {n} replica(s)" for n in sorted(per))


def _num(value: float | None, digits: int = 1) -> str:
    return "-" if value is None else f"{value:.{digits}f}"


def _signed(value: float) -> str:
    return f"{value:+.2f}"


def _scaling_lines(payload: Mapping[str, Any]) -> list[str]:
    cpus = payload["environment"]["cpu_count"]
    lines = [f"This machine has {cpus} CPU cores, and every process of the run shares them: PostgreSQL, the stub, "
             "the SnD server, every replica and the clients."]
    most = max((r["replicas"] for r in payload["rows"]), default=1)
    if most > 1 and cpus is not None and cpus <= 2:
        lines[0] += (f" On {cpus} cores, {most} replicas cannot be faster than one that already fills the cores: "
                     "they share them, and each adds its own process and memory.")
    for s in payload["scaling"]:
        verdict = "more" if s["throughput_ratio"] > 1 else "less" if s["throughput_ratio"] < 1 else "the same"
        busy = ("" if s.get("cpu_busy") is None or s.get("against_cpu_busy") is None else
                f"; the machine's cores were busy {s['against_cpu_busy']:.0%} of the time with {s['against_replicas']}"
                f" and {s['cpu_busy']:.0%} with {s['replicas']}")
        lines.append(f"- {s['endpoint']}, {s['clients']} clients: {s['replicas']} replicas answered "
                     f"{s['throughput_ratio']:.2f} x the throughput of {s['against_replicas']} ({verdict}){busy}.")
    gains = [s for s in payload["scaling"] if s["throughput_ratio"] > 1 and s.get("against_cpu_busy") is not None]
    if gains:
        idle = max(1 - s["against_cpu_busy"] for s in gains)
        lines += ["", f"Where more replicas answered more, one replica had left up to {idle:.0%} of the cores idle, "
                      "and the others used that share. That is the most more replicas can give on one machine; "
                      "capacity beyond its cores comes only from replicas on other machines."]
    return [*lines, ""]


def _ledger_lines(payload: Mapping[str, Any]) -> list[str]:
    ledger = payload["ledger"]
    alone = ledger["alone"]
    lines = ["## The ledger's added latency", "",
             "In process: `Ledger.spend_all` of one spend for one principal, timed per call, in turn and then over "
             "threads (every call waits for the same row).", "",
             "| ledger | calls | p50 ms | p99 ms | threads | p50 ms | p99 ms | spends/s | every call charged | "
             "durability |", "|---" * 10 + "|"]
    for name, figures in alone.items():
        serial, concurrent = figures["serial"], figures["concurrent"]
        lines.append(f"| {name} | {figures['calls']} | {serial['p50_ms']:.2f} | {serial['p99_ms']:.2f} | "
                     f"{concurrent['threads']} | {concurrent['p50_ms']:.2f} | {concurrent['p99_ms']:.2f} | "
                     f"{concurrent['spends_per_s']:.0f} | {figures['charged_every_call']} | "
                     f"{', '.join(f'{k} {v}' for k, v in figures['durability'].items())} |")
    if (added := ledger.get("added_alone_ms")) is not None:
        threads = alone[POSTGRESQL]["concurrent"]["threads"]
        lines += ["", f"PostgreSQL minus SQLite, per spend: p50 {_signed(added['serial_p50_ms'])} ms, p99 "
                      f"{_signed(added['serial_p99_ms'])} ms in turn; p50 {_signed(added['concurrent_p50_ms'])} ms, "
                      f"p99 {_signed(added['concurrent_p99_ms'])} ms over {threads} threads."]
        pg = alone[POSTGRESQL]["durability"]
        if pg.get("fsync") == "off" or pg.get("synchronous_commit") == "off":
            lines.append("This PostgreSQL is the bench's own test server, which does not flush commits to disk "
                         f"(fsync {pg.get('fsync')}, synchronous_commit {pg.get('synchronous_commit')}); a "
                         "production server that flushes each commit adds a disk flush to every spend.")
    e2e = ledger.get("end_to_end")
    if e2e is not None:
        lines += ["", f"End to end: the one-replica gateway (Ray), both ledgers on SQLite, then on PostgreSQL, chat at "
                      f"{e2e['clients']} clients: p50 {e2e['sqlite_p50_ms']:.1f} ms on SQLite, "
                      f"{e2e['postgresql_p50_ms']:.1f} ms on PostgreSQL, a difference of "
                      f"{_signed(e2e['added_p50_ms'])} ms per request. One run of each: the difference also holds the "
                      "run-to-run variation of the gateway's latency, which the in-process figures above do not."]
    return [*lines, ""]


def replica_markdown(payload: Mapping[str, Any]) -> str:
    """results.md: the rows, what more replicas did on this machine, the ledger's added latency."""
    meta, setting, gateway = payload["metadata"], payload["setting"], payload["gateway"]
    machine = meta.get("machine", {})
    lines = ["# `privlm gateway --ray --replicas N` against the stub upstream (localhost)", "",
             f"- command: `{meta.get('command')}`", f"- git commit: `{meta.get('git_commit')}`",
             f"- machine: {machine.get('cpu_count')} CPUs, torch threads {machine.get('torch_threads')}, "
             f"{machine.get('platform')}",
             *([f"- load average (1, 5, 15 min) at the start "
                f"{'/'.join(f'{v:.2f}' for v in load['start'])}, at the end "
                f"{'/'.join(f'{v:.2f}' for v in load['end'])}"]
               if (load := payload["environment"].get("load_average")) else []),
             f"- chat: Cape on SmolLM2 at epsilon {gateway['chat']['epsilon_per_token']:g} per token, conversation "
             f"memory {gateway['chat']['memory']} (every request perturbed); embeddings: SnD at eta "
             f"{gateway['embeddings']['eta']:g}, {gateway['embeddings']['sentences_per_request']} sentences per "
             f"request; {setting['requests_per_client']} requests per client after a warm-up; "
             f"{_cpus_line(payload)}; both ledgers of each gateway in a database of "
             "its own, budgets no run reaches (every request checked and charged, none refused)", "",
             "## Throughput and latency", "",
             "| replicas | ledger | endpoint | clients | requests/s | sentences/s | p50 ms | p99 ms | replicas that "
             "answered | answered | errors | cores busy |", "|---" * 12 + "|"]
    for r in payload["rows"]:
        busy = "-" if r.get("cpu_busy") is None else f"{r['cpu_busy']:.0%}"
        lines.append(f"| {r['replicas']} | {r['ledger']} | {r['endpoint']} | {r['clients']} | "
                     f"{r['requests_per_s']:.2f} | {_num(r['sentences_per_s'])} | {_num(r['p50_ms'])} | "
                     f"{_num(r['p99_ms'])} | {r['replicas_seen']} | {r['answered']} | {r['errors']} | {busy} |")
    failures = [r for r in payload["rows"] if r["errors"]]
    lines += [f"- first error, {r['replicas']} replica(s) {r['endpoint']} {r['clients']} clients: {r['first_error']}"
              for r in failures]
    lines += ["", *_scaling_lines(payload), *_ledger_lines(payload),
              "Throughput: answered requests over the row's wall time. Latency: until the whole answer was read. "
              "Replicas that answered: distinct `x-privlm-replica` headers among the row's answers. Cores busy: the "
              "share of the machine's CPU time (all cores) not idle during the row."]
    return "\n".join(lines) + "\n"
