"""`privlm bench serve --gateway-replicas`: option parsing, the run's plan, the rows, the ledger's timing on SQLite
and PostgreSQL, and the report written from a synthetic payload (no Ray here: the Ray gateway has its own test)."""

from __future__ import annotations

import asyncio
import json

import httpx
import numpy as np
import pytest
from typer.testing import CliRunner

from privlm_bench.chat.gateway_replicas import (
    CHAT,
    EMBEDDINGS,
    LEDGER_CLIENTS,
    POSTGRESQL,
    REPLICA_HEADER,
    SQLITE,
    GatewayRun,
    ReplicaBenchSetting,
    ReplicaTally,
    chat_row,
    embeddings_row,
    end_to_end,
    ledger_comparison,
    ledger_latency,
    parse_replica_counts,
    plan,
    replica_gateway_args,
    replica_markdown,
    replica_results,
    scaling,
    write_replica_report,
)
from privlm_bench.chat.load import LoadResult, Timing


@pytest.mark.parametrize(("text", "counts"), [("1,2", (1, 2)), (" 2 , 4", (2, 4)), ("3", (3,))])
def test_replica_counts_parse(text, counts):
    assert parse_replica_counts(text) == counts


@pytest.mark.parametrize("text", ["", "0", "1,x", "-1", "1,,2", "1.5", "1,1"])
def test_bad_replica_counts_are_refused(text):
    with pytest.raises(ValueError, match=r"replicas|integers"):
        parse_replica_counts(text)


@pytest.mark.parametrize(("args", "hint"), [(["--gateway-replicas", "0,2"], "--gateway-replicas"),
                                            (["--gateway-replicas", "2,2"], "--gateway-replicas"),
                                            (["--gateway-replicas", "1", "--requests", "0"], "--requests"),
                                            (["--gateway-replicas", "1", "--ledger-calls", "0"], "ledger_calls")])
def test_the_cli_refuses_bad_input_before_starting_anything(args, hint, tmp_path):
    from privlm.cli import app

    result = CliRunner().invoke(app, ["bench", "serve", "--out", str(tmp_path), *args])
    assert result.exit_code == 2, (result.output, result.exception)
    assert hint in " ".join(result.output.replace("│", " ").split())
    assert not any(tmp_path.iterdir())


def test_the_plan_puts_both_ledgers_of_one_replica_back_to_back():
    full = plan(ReplicaBenchSetting(replicas=(1, 2)))
    assert [(r.replicas, r.ledger) for r in full] == [(1, POSTGRESQL), (1, SQLITE), (2, POSTGRESQL)]
    assert set(full[0].rows) == set(full[2].rows) == {(e, c) for e in (CHAT, EMBEDDINGS) for c in (8, 32)}
    assert full[1].rows == ((CHAT, LEDGER_CLIENTS),)
    without_one = plan(ReplicaBenchSetting(replicas=(2, 3)))
    assert [(r.replicas, r.ledger, len(r.rows)) for r in without_one] == [
        (1, POSTGRESQL, 1), (1, SQLITE, 1), (2, POSTGRESQL, 4), (3, POSTGRESQL, 4)]


def test_gateway_args_name_the_replicas_and_a_secret_only_for_postgresql(tmp_path):
    def args(secret):
        return replica_gateway_args(8123, stub_url="http://s", server_url="http://e", replicas=2, replica_cpus=0.5,
                                    epsilon=6.0, logit_bound=tmp_path / "b.json", chat_ledger="postgresql://x/c",
                                    ledger="postgresql://x/e", secret=secret, max_in_flight=64)

    with_secret = args(tmp_path / "s")
    for flag, value in [("--replicas", "2"), ("--replica-cpus", "0.5"), ("--chat-ledger", "postgresql://x/c"),
                        ("--ledger", "postgresql://x/e"), ("--ledger-secret", str(tmp_path / "s")),
                        ("--chat-ledger-secret", str(tmp_path / "s")),
                        ("--chat-memory", "off"), ("--server", "http://e"), ("--chat-upstream", "http://s")]:
        assert with_secret[with_secret.index(flag) + 1] == value
    assert "--ray" in with_secret and "--ledger-secret" not in args(None) and "--chat-ledger-secret" not in args(None)


def test_the_tally_counts_distinct_replica_headers():
    tally = ReplicaTally()
    for replica in ["a", "b", "a", None]:
        headers = {REPLICA_HEADER: replica} if replica else {}
        asyncio.run(tally(httpx.Response(200, headers=headers)))
    assert tally.take() == ["a", "b"] and tally.take() == []


def test_rows_from_the_loads():
    result = LoadResult(clients=2, requests_per_client=2, wall_s=0.5,
                        timings=[Timing(0.1), Timing(0.2), Timing(0.3)], errors=["HTTP 503: down"])
    row = chat_row(result, replicas=2, ledger=POSTGRESQL, seen=["a", "b"])
    assert row["requests_per_s"] == pytest.approx(3 / 0.5) and row["answered"] == 3 and row["errors"] == 1
    assert row["p50_ms"] == pytest.approx(200.0) and row["replicas_seen"] == 2
    assert chat_row(LoadResult(clients=1, requests_per_client=1, wall_s=0.1, errors=["x"]), replicas=1,
                    ledger=SQLITE, seen=[])["p50_ms"] is None
    embedded = embeddings_row({"clients": 8, "sentences_per_s": 96.0, "p50_ms": 5.0, "p99_ms": 9.0, "requests": 32},
                              replicas=1, ledger=POSTGRESQL, requests_per_client=4, seen=["a"])
    assert embedded["requests_per_s"] == pytest.approx(12.0) and embedded["answered"] == 32


@pytest.mark.parametrize("backend", [SQLITE, POSTGRESQL])
def test_ledger_latency_times_every_spend_and_charges_it(backend, tmp_path, request):
    location = tmp_path / "ledger.sqlite" if backend == SQLITE else request.getfixturevalue("postgres_url")
    figures = ledger_latency(location, secret=tmp_path / "secret", calls=6, threads=3)
    assert figures["backend"] == backend and figures["charged_every_call"] is True
    assert figures["serial"]["n"] == figures["concurrent"]["n"] == 6 and figures["concurrent"]["threads"] == 3
    assert 0 < figures["serial"]["p50_ms"] <= figures["serial"]["p99_ms"]
    assert set(figures["durability"]) == ({"synchronous", "journal_mode"} if backend == SQLITE
                                          else {"fsync", "synchronous_commit"})


def _synthetic(cpu_count: int, *, fsync: str = "off") -> dict:
    """A payload of random figures (seeded), shaped as a run writes it."""
    rng = np.random.default_rng(7)
    rows = []
    for replicas in (1, 2):
        for endpoint in (CHAT, EMBEDDINGS):
            for clients in (8, 32):
                rate = float(rng.uniform(1, 50))
                rows.append({"endpoint": endpoint, "replicas": replicas, "ledger": POSTGRESQL, "clients": clients,
                             "requests_per_client": 4, "answered": 4 * clients, "errors": 0, "first_error": None,
                             "requests_per_s": rate, "sentences_per_s": 8 * rate if endpoint == EMBEDDINGS else None,
                             "p50_ms": float(rng.uniform(10, 500)), "p99_ms": float(rng.uniform(500, 900)),
                             "replicas_seen": replicas})
    rows.append({**rows[0], "ledger": SQLITE, "p50_ms": float(rng.uniform(10, 500))})

    def ledger(backend: str) -> dict:
        durability = {"fsync": fsync, "synchronous_commit": "on"} if backend == POSTGRESQL else {
            "synchronous": "FULL", "journal_mode": "wal"}
        return {"backend": backend, "calls": 20, "charged_every_call": True, "durability": durability,
                "serial": {"p50_ms": float(rng.uniform(0.5, 3)), "p99_ms": float(rng.uniform(3, 9)), "n": 20},
                "concurrent": {"p50_ms": float(rng.uniform(0.5, 3)), "p99_ms": float(rng.uniform(3, 9)), "n": 20,
                               "threads": 8, "spends_per_s": float(rng.uniform(100, 900))}}

    meta = {"command": "privlm bench serve --gateway-replicas 1,2", "git_commit": "abc", "seed": 0,
            "machine": {"cpu_count": cpu_count, "torch_threads": 1, "platform": "test"}}
    payload = replica_results(ReplicaBenchSetting(), rows, {SQLITE: ledger(SQLITE), POSTGRESQL: ledger(POSTGRESQL)},
                              meta=meta)
    payload["environment"] |= {"cpu_count": cpu_count, "omp_num_threads": "1"}
    return payload


def test_the_report_is_computed_from_the_figures(tmp_path):
    payload = _synthetic(2)
    files = write_replica_report(tmp_path, payload)
    assert json.loads(files[0].read_text())["rows"] == payload["rows"]
    text = files[1].read_text()
    assert text == replica_markdown(payload)
    assert "2 replicas cannot be faster than one" in text
    by = {(r["endpoint"], r["clients"], r["replicas"]): r["requests_per_s"]
          for r in payload["rows"] if r["ledger"] == POSTGRESQL}
    for endpoint in (CHAT, EMBEDDINGS):
        for clients in (8, 32):
            ratio = by[endpoint, clients, 2] / by[endpoint, clients, 1]
            assert (f"- {endpoint}, {clients} clients: 2 replicas answered {ratio:.2f} x the throughput of 1 "
                    f"({'more' if ratio > 1 else 'less'})") in text
    for row in payload["rows"]:
        assert f"| {row['requests_per_s']:.2f} |" in text
    alone = payload["ledger"]["alone"]
    added = alone[POSTGRESQL]["serial"]["p50_ms"] - alone[SQLITE]["serial"]["p50_ms"]
    assert f"p50 {added:+.2f} ms" in text
    e2e = payload["ledger"]["end_to_end"]
    assert e2e["added_p50_ms"] == pytest.approx(e2e["postgresql_p50_ms"] - e2e["sqlite_p50_ms"])
    assert f"{e2e['added_p50_ms']:+.2f} ms per request" in text
    assert "does not flush commits to disk" in text


def test_the_report_makes_no_two_core_claim_on_a_larger_machine_nor_a_flush_claim_when_flushing():
    text = replica_markdown(_synthetic(16, fsync="on"))
    assert "cannot be faster" not in text and "This machine has 16 CPU cores" in text
    assert "does not flush commits to disk" not in text


def test_comparisons_from_rows():
    rows = _synthetic(2)["rows"]
    [sqlite] = [r for r in rows if r["ledger"] == SQLITE]
    e2e = end_to_end(rows)
    assert e2e is not None and e2e["sqlite_p50_ms"] == sqlite["p50_ms"]
    assert end_to_end([r for r in rows if r["ledger"] != SQLITE]) is None
    assert {(s["endpoint"], s["clients"]) for s in scaling(rows)} == {(e, c) for e in (CHAT, EMBEDDINGS)
                                                                      for c in (8, 32)}
    comparison = ledger_comparison({"serial": {"p50_ms": 1.0, "p99_ms": 2.0}, "concurrent": {"p50_ms": 3.0,
                                                                                            "p99_ms": 4.0}},
                                   {"serial": {"p50_ms": 1.5, "p99_ms": 1.0}, "concurrent": {"p50_ms": 3.0,
                                                                                            "p99_ms": 6.0}})
    assert comparison == {"serial_p50_ms": 0.5, "serial_p99_ms": -1.0, "concurrent_p50_ms": 0.0,
                          "concurrent_p99_ms": 2.0}
    assert GatewayRun(1, SQLITE, ()).ledger == SQLITE


def test_cores_busy_is_the_share_not_idle_and_the_report_says_what_a_gain_used():
    from collections import namedtuple

    from privlm_bench.chat.gateway_replicas import cpu_busy

    Times = namedtuple("Times", "user system idle iowait")
    assert cpu_busy(Times(10, 5, 100, 0), Times(40, 15, 150, 10)) == pytest.approx(40 / 100)
    assert cpu_busy(Times(1, 1, 1, 0), Times(1, 1, 1, 0)) == 0.0  # no time passed
    payload = _synthetic(2)
    for row in payload["rows"]:
        row["cpu_busy"] = 0.55 if row["replicas"] == 1 else 0.97
    payload["scaling"] = scaling(payload["rows"])
    text = replica_markdown(payload)
    assert "| 55% |" in text and "| 97% |" in text
    assert any(s["throughput_ratio"] > 1 for s in payload["scaling"])  # the seeded figures have a gain
    assert "busy 55% of the time with 1 and 97% with 2" in text and "left up to 45% of the cores idle" in text


def test_the_cores_are_shared_out_over_the_replicas_unless_a_reservation_is_given():
    import os

    cores = os.cpu_count() or 1
    assert ReplicaBenchSetting().cpus_per_replica(2) == cores / 2
    assert ReplicaBenchSetting(replica_cpus=0.5).cpus_per_replica(2) == 0.5
    payload = _synthetic(2)
    for row in payload["rows"]:
        row["replica_cpus"] = 2.0 / row["replicas"]
    assert "CPUs reserved per replica (its torch threads): 2 with 1 replica(s), 1 with 2 replica(s)" in \
        replica_markdown(payload)
