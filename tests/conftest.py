"""The fixtures every folder shares (real and tiny models, the chat stub upstream), the ``slow`` marker put on every
test that loads a real model, and what makes the suite safe under pytest-xdist (a cache per worker; each module
runs whole on one worker)."""

from __future__ import annotations

import functools
import os
import socket
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np
import pytest
import torch
from xdist.scheduler import LoadGroupScheduling

import privlm.service.process
from tests.support.without_bench import ENV as WITHOUT_BENCH
from tests.support.without_bench import block_bench

# The product's tests as they run without the bench kit (`.ci/run`): the kit unimportable, its tests left out.
if os.environ.get(WITHOUT_BENCH):
    block_bench()
    collect_ignore = ["bench"]

# Each worker picks the ports of the servers it starts from a block of its own, below the range the OS hands out for
# port 0 and for outgoing connections (32768 and up on Linux): a port one worker picked free cannot be taken by
# another worker's server before the process that was given it binds it, so a health check never reaches another
# worker's server. Patched before any test module imports ``free_port``.
_WORKERS = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1"))
_WORKER = int(os.environ.get("PYTEST_XDIST_WORKER", "gw0").removeprefix("gw") or 0)
_BLOCK = 12000 // max(_WORKERS, 1)
_next_port = iter(range(20000 + _WORKER * _BLOCK, 20000 + (_WORKER + 1) * _BLOCK))


def _worker_free_port() -> int:
    for port in _next_port:  # each port once: a test never gets a port an earlier test's process may still hold
        with socket.socket() as sock:
            try:
                sock.bind(("127.0.0.1", port))
            except OSError:
                continue
            return port
    raise RuntimeError("this test worker used up its block of ports")


privlm.service.process.free_port = _worker_free_port

# Under xdist, each worker (and every process it starts) gets its share of the cores: torch's default, a thread per
# core in every worker, oversubscribes the machine, and its threads then wait on each other (a SmolLM2 generation
# test took 50 s in a parallel run on a busy machine, 8 s alone; after this and a lighter CLI start, 10 s).
if "PYTEST_XDIST_WORKER" in os.environ:
    _threads = max(1, (os.cpu_count() or 1) // _WORKERS)
    torch.set_num_threads(_threads)
    os.environ["OMP_NUM_THREADS"] = os.environ["MKL_NUM_THREADS"] = str(_threads)

if TYPE_CHECKING:  # the modules that load transformers are imported once the variables below are set
    from privlm.models import SplitModel
    from privlm.models.chat import ChatModel
    from privlm.models.language import LanguageModel
    from tests.support.chat import StubUpstream

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

# The strict threshold of the project's statistical tests.
P_THRESHOLD = 1e-6

BAD_POSITIVE_REALS = [0, 0.0, -1, -0.5, float("nan"), float("inf"), float("-inf"), "1", None, True]


def assert_draws_follow(draws: torch.Tensor, probabilities: torch.Tensor) -> None:
    """Chi-square test, at the project's threshold, that sampled ids follow exact probabilities."""
    from scipy import stats

    n, size = draws.numel(), probabilities.numel()
    observed = np.bincount(draws.flatten().numpy(), minlength=size)
    expected = probabilities.double().numpy() * n
    support = expected > 0
    assert observed[~support].sum() == 0  # never a draw of probability 0 (outside a top-p set, say)
    assert stats.chisquare(observed[support], expected[support]).pvalue > P_THRESHOLD


def spy_on_forward(model: torch.nn.Module, record: Callable[[], object]) -> list[object]:
    """Replace ``model.forward`` by a spy that appends ``record()`` before each call; returns the list. The spy keeps
    forward's signature, which the key/value cache's argument name is read from."""
    calls: list[object] = []
    forward = model.forward

    @functools.wraps(forward)
    def spy(*args: Any, **kwargs: Any) -> Any:
        calls.append(record())
        return forward(*args, **kwargs)

    model.forward = spy  # type: ignore[method-assign]
    return calls


@pytest.fixture
def generator() -> torch.Generator:
    """A seeded generator, so that a statistical failure can be replayed."""
    g = torch.Generator()
    g.manual_seed(20261121)
    return g


# -- real packaged models: session-scoped, so each loads once per worker; a test that uses one is marked slow --------

REAL_MODELS = frozenset({"minilm", "smollm2", "smollm2_lm", "chat_model",
                         "smollm2_tokenizer"})  # tests/models/test_prompts.py: converts the packaged GGUF


@pytest.fixture(scope="session")
def minilm() -> SplitModel:
    from privlm.models import SplitModel

    return SplitModel.from_pretrained("minilm", device="cpu")


@pytest.fixture(scope="session")
def smollm2() -> SplitModel:
    """SmolLM2 as a split model (its input layer, blocks and pooling: SnD, the attacks)."""
    from privlm.models import SplitModel

    return SplitModel.from_pretrained("smollm2", device="cpu")


@pytest.fixture(scope="session")
def smollm2_lm() -> LanguageModel:
    """SmolLM2 with its head: Cape's device model, the token-level baselines' vocabulary."""
    from privlm.models.language import LanguageModel

    return LanguageModel.from_pretrained("smollm2", device="cpu")


@pytest.fixture(scope="session")
def chat_model(smollm2_lm: LanguageModel) -> ChatModel:
    """SmolLM2 answering chat messages, on the same weights as ``smollm2_lm`` (generation changes none)."""
    from privlm.models.chat import ChatModel

    return ChatModel(smollm2_lm)


# -- tiny random models: built in a second, from configs ---------------------------------------------------------

@pytest.fixture(scope="session")
def tiny_bert(tmp_path_factory: pytest.TempPathFactory) -> SplitModel:
    """A tiny random BERT with a real WordPiece tokenizer, loaded from a local folder named ``model`` (the SnD
    gateway's id for it is ``privlm-snd-model``)."""
    from privlm.models import SplitModel
    from tests.models.tiny import tiny_bert_folder

    return SplitModel.from_pretrained(tiny_bert_folder(tmp_path_factory.mktemp("tiny-bert") / "model"), device="cpu")


@pytest.fixture(scope="session")
def tiny_masked_lm(tmp_path_factory: pytest.TempPathFactory) -> LanguageModel:
    """A tiny random BertForMaskedLM (64 positions, WordPiece tokenizer) as a device LanguageModel."""
    from privlm.models.language import LanguageModel
    from tests.models.tiny import tiny_masked_lm_folder

    return LanguageModel.from_pretrained(tiny_masked_lm_folder(tmp_path_factory.mktemp("tiny-mlm")), device="cpu")


@pytest.fixture(scope="session")
def vendor_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A saved 3-block random BERT with MiniLM's tokenizer: a SAP vendor's model folder that loads in a second."""
    from tests.models.tiny import tiny_bert_with_minilm_tokenizer

    return tiny_bert_with_minilm_tokenizer(tmp_path_factory.mktemp("sap-vendor-model"), blocks=3)


# -- servers ------------------------------------------------------------------------------------------------------

@pytest.fixture(scope="session")
def stub() -> Iterator[StubUpstream]:
    """The chat gateway tests' OpenAI-compatible upstream (tests/support/chat.py), on a real uvicorn server."""
    from tests.service.localhost import serving
    from tests.support.chat import StubUpstream, stub_app

    record = StubUpstream()
    with serving(stub_app(record)) as url:
        record.url, record.port = url, int(url.rsplit(":", 1)[1])
        yield record


# -- running under pytest-xdist -----------------------------------------------------------------------------------

@pytest.fixture(autouse=True, scope="session")
def worker_cache(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Path]:
    """``$PRIVLM_CACHE`` for this worker (neighbour sets, bundles, default ledgers): two workers never write the same
    file. Its ``models`` (SmolLM2 converted from GGUF: a minute of CPU) is the user's, shared: a conversion is
    published whole, by a rename (``privlm.models.loading.materialise_gguf``)."""
    from privlm.models.sources import cache_dir

    shared_models = cache_dir() / "models"
    shared_models.mkdir(parents=True, exist_ok=True)
    cache = tmp_path_factory.getbasetemp() / "privlm-cache"
    cache.mkdir(exist_ok=True)
    (cache / "models").symlink_to(shared_models, target_is_directory=True)
    saved = os.environ.get("PRIVLM_CACHE")
    os.environ["PRIVLM_CACHE"] = str(cache)
    yield cache
    if saved is None:
        os.environ.pop("PRIVLM_CACHE", None)
    else:
        os.environ["PRIVLM_CACHE"] = saved


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """Every test that loads a real packaged model, through its fixtures, is slow (``make test-fast`` skips it)."""
    for item in items:
        if REAL_MODELS & set(getattr(item, "fixturenames", ())):
            item.add_marker(pytest.mark.slow)


# The longest groups of a whole run (seconds on 2 workers, measured 2026-11-25, the PostgreSQL ones 2026-11-26), sent
# to the workers first: with whole modules per worker, the run ends when its last module does, so a long one must
# never start last. "ray" is the xdist group of the Ray modules.
LONGEST_FIRST = (
    "ray",  # 150 (the gateway's replicas: 40)
    "tests/test_cli.py",  # 90
    "tests/bench/test_sap_bench.py",  # 60
    "tests/test_cli_refusals.py",  # 55
    "tests/bench/test_cape_bench.py",  # 50
    "tests/gateway/test_gateway_postgres.py",  # 40: a PostgreSQL server of each test's own, stopped and started
    "tests/accounting/test_ledger.py",  # 35: every test on SQLite and on PostgreSQL
    "tests/snd/service/test_hardening.py",  # 35
    "tests/sap/service/test_vendor_server.py",  # 30
    "tests/bench/test_hardening.py",  # 25
    "tests/test_docs.py",  # 25
    "tests/gateway/test_gateway_cli.py",  # 20
    "tests/bench/test_llm_server.py",  # 20
)


class ModuleOrGroupScheduling(LoadGroupScheduling):
    """xdist's ``loadgroup``, with each module a group unless an ``xdist_group`` mark names one: a module's tests
    run in order on one worker (module-scoped servers start once; some tests build on the one before), and the
    modules that share a group (``ray``: one local cluster at a time) never run at once. The groups of
    ``LONGEST_FIRST`` go out first, in its order; the rest follow, most tests first (xdist's order)."""

    def _split_scope(self, nodeid: str) -> str:
        if nodeid.rfind("@") > nodeid.rfind("]"):
            return nodeid.split("@")[-1]
        return nodeid.split("::", 1)[0]

    def _assign_work_unit(self, node: Any) -> None:
        longest = next((scope for scope in LONGEST_FIRST if scope in self.workqueue), None)
        if longest is not None:
            self.workqueue.move_to_end(longest, last=False)
        super()._assign_work_unit(node)


def pytest_xdist_make_scheduler(config: pytest.Config, log: Any) -> ModuleOrGroupScheduling | None:
    return ModuleOrGroupScheduling(config, log) if config.getvalue("dist") == "loadgroup" else None


# --- PostgreSQL: a real server (`.ci/run` starts one; else each worker starts its own), a fresh database per test --
@pytest.fixture(scope="session")
def postgres_server() -> Iterator[str]:
    """The URL of a PostgreSQL server whose user may create databases: ``$PRIVLM_TEST_POSTGRES_URL``, or a server
    started here (no PostgreSQL installed: the test fails and says how to install it)."""
    from privlm.accounting.postgres_server import URL_ENV, PostgresMissingError, PostgresServer

    if os.environ.get(URL_ENV):
        yield os.environ[URL_ENV]
        return
    server = PostgresServer()
    try:
        url = server.start()
    except PostgresMissingError as error:
        pytest.fail(str(error))
    try:
        yield url
    finally:
        server.remove()


@pytest.fixture
def postgres_url(postgres_server: str) -> Iterator[str]:
    """A new, empty database on :func:`postgres_server`, dropped after the test."""
    import uuid

    import psycopg

    name = f"privlm_test_{uuid.uuid4().hex[:16]}"
    with psycopg.connect(postgres_server, autocommit=True) as admin:
        admin.execute(f"CREATE DATABASE {name}")
    url = postgres_server.rsplit("/", 1)[0] + "/" + name
    yield url
    from privlm.accounting.database import close_pools

    close_pools(url)
    with psycopg.connect(postgres_server, autocommit=True) as admin:
        admin.execute(f"DROP DATABASE IF EXISTS {name} WITH (FORCE)")
