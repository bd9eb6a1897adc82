"""Issue 10, finding 5: keys could be given only on the command line (where /proc/PID/cmdline shows them to
every user), and the shipped systemd unit expanded ``--api-key ${PRIVLM_API_KEY}``. Keys now also come from
a file and from the environment, one shared loader refuses every empty or unsafe source by name, and
``Authorization`` is read by RFC 6750 the same way before and after the body is read."""

from __future__ import annotations

import os
import re
import shlex
import socket
from collections.abc import Sequence
from pathlib import Path

import httpx
import pytest
import typer
from fastapi import APIRouter, Request
from typer.testing import CliRunner

from privlm.cli import app
from privlm.service import BearerKeys, create_service_app
from privlm.service.auth import (
    API_KEYS_ENV,
    GATEWAY_API_KEYS_ENV,
    KEY_ENV_VARS,
    SERVER_API_KEY_ENV,
    InsecureKeyFileWarning,
    KeySourceError,
    bearer_key,
    load_key,
    load_keys,
    read_key_file,
    request_key,
)
from privlm.service.process import stop
from tests.service.localhost import serving, start_privlm_on_free_port

ROOT = Path(__file__).parents[2]
runner = CliRunner()
FILE_KEYS = ("file-key-one", "file-key-two")
ENV_KEYS = ("env-key-one", "env-key-two")
CLI_KEY = "cli-key-visible"


def _key_file(folder: Path, text: str, mode: int = 0o600, name: str = "keys") -> Path:
    path = folder / name
    path.write_text(text)
    path.chmod(mode)
    return path


@pytest.fixture(autouse=True)
def _no_keys_in_the_environment(monkeypatch):
    for name in KEY_ENV_VARS:
        monkeypatch.delenv(name, raising=False)


# --- a real `privlm serve`, keys from a file, the environment and the command line ---------------------------


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    from tests.models.tiny import tiny_bert_folder

    folder = tiny_bert_folder(tmp_path_factory.mktemp("tiny"))
    key_file = _key_file(tmp_path_factory.mktemp("keys"),
                         "# accepted keys\n\n" + "\n".join(FILE_KEYS) + "\n  # not-a-key\n")
    env = {name: value for name, value in os.environ.items() if name not in KEY_ENV_VARS}
    process, port = start_privlm_on_free_port(
        lambda port: ["serve", "--model", str(folder), "--port", str(port), "--device", "cpu",
                      "--api-key-file", str(key_file), "--api-key", CLI_KEY],
        env={**env, API_KEYS_ENV: "\n" + ",".join(ENV_KEYS) + "\n"})
    yield f"http://127.0.0.1:{port}", process
    stop(process)


@pytest.mark.slow
def test_finding_5_keys_from_a_file_and_the_environment_guard_a_real_server(served):
    url, _ = served
    for key in (*FILE_KEYS, *ENV_KEYS, CLI_KEY):  # a key on the command line still works
        assert httpx.get(f"{url}/metrics", headers={"authorization": f"Bearer {key}"}).status_code == 200, key
    for headers in ({}, {"authorization": "Bearer wrong"}, {"authorization": "Bearer # not-a-key"},
                    {"authorization": "Bearer not-a-key"}, {"authorization": f"Bearer {','.join(ENV_KEYS)}"}):
        assert httpx.get(f"{url}/metrics", headers=headers).status_code == 401, headers


@pytest.mark.slow
@pytest.mark.skipif(not Path("/proc/self/cmdline").exists(), reason="needs Linux's /proc")
def test_finding_5_keys_from_a_file_or_the_environment_stay_out_of_the_process_list(served):
    """What every user of the machine can read: /proc/PID/cmdline. The key given with --api-key is there (the
    detector works), the keys of --api-key-file and of PRIVLM_API_KEYS are not."""
    _, process = served
    cmdline = Path(f"/proc/{process.pid}/cmdline").read_bytes().decode()
    assert "--api-key-file" in cmdline and CLI_KEY in cmdline
    for key in (*FILE_KEYS, *ENV_KEYS):
        assert key not in cmdline


# --- every empty or unsafe source is refused by name, as a usage error ----------------------------------------


def _refusal(args: list[str], env: dict[str, str] | None = None) -> str:
    result = runner.invoke(app, args, env={"COLUMNS": "1000", **(env or {})})  # no path cut by a line break
    assert result.exit_code == 2, result.output  # a usage error (click), before any model is loaded
    assert isinstance(result.exception, SystemExit) and "Traceback" not in result.output
    return " ".join(result.output.replace("│", " ").split())


GATEWAY = ["gateway", "--server", "http://127.0.0.1:9", "--eta", "50"]


def test_finding_5_empty_keys_from_any_source_are_refused_with_a_clear_message(tmp_path):
    """``--api-key ""`` (what ``--api-key ${PRIVLM_API_KEY}`` gives when the variable is empty), an empty
    variable, an empty key between commas, an empty or comment-only file, a missing file: each is a usage
    error that names its source, never an open server."""
    empty, comments = _key_file(tmp_path, "", name="empty"), _key_file(tmp_path, "# none\n\n", name="comments")
    cases = [
        (["serve", "--api-key", ""], None, "--api-key: is empty; an empty key would leave the service open"),
        (["serve"], {API_KEYS_ENV: ""}, f"environment variable {API_KEYS_ENV}: is empty"),
        (["serve"], {API_KEYS_ENV: "a,,b"}, f"environment variable {API_KEYS_ENV}: key 2 is empty"),
        (["serve", "--api-key-file", str(empty)], None, f"key file {empty}: holds no key"),
        (["serve", "--api-key-file", str(comments)], None, f"key file {comments}: holds no key"),
        (["serve", "--api-key-file", str(tmp_path / "absent")], None, "absent: does not exist"),
        (["serve", "--api-key-file", str(tmp_path)], None, "cannot be read"),
        ([*GATEWAY, "--api-key", ""], None, "--api-key: is empty"),
        ([*GATEWAY], {GATEWAY_API_KEYS_ENV: " "}, f"environment variable {GATEWAY_API_KEYS_ENV}: is empty"),
        ([*GATEWAY, "--api-key-file", str(empty)], None, "holds no key"),
        ([*GATEWAY, "--server-api-key", ""], None, "--server-api-key: is empty"),
        ([*GATEWAY], {SERVER_API_KEY_ENV: ""}, f"environment variable {SERVER_API_KEY_ENV}: is empty"),
        ([*GATEWAY, "--server-api-key-file", str(comments)], None, "holds no key"),
    ]
    for args, env, message in cases:
        assert message in _refusal(args, env), (args, env)


def test_finding_5_key_files_every_user_can_read_are_refused(tmp_path):
    shared = _key_file(tmp_path, "k1\n", mode=0o644)
    assert "is readable by every user (mode 644)" in _refusal(["serve", "--api-key-file", str(shared)])
    group = _key_file(tmp_path, "k1\n", mode=0o640, name="group")
    with pytest.warns(InsecureKeyFileWarning, match="readable by its group"):
        assert read_key_file(group) == ("k1",)


def test_finding_5_key_sources_parse_alike_and_never_quote_a_key(tmp_path):
    path = _key_file(tmp_path, "# comment\n  alpha  \n\nbeta\n#gamma\nalpha\n")
    assert read_key_file(path) == ("alpha", "beta", "alpha")
    environ = {API_KEYS_ENV: "delta,\n epsilon \n"}
    with pytest.raises(KeySourceError, match="key 2 is empty"):
        load_keys(env_var=API_KEYS_ENV, environ=environ)
    environ = {API_KEYS_ENV: "delta, epsilon\nzeta\n"}
    assert load_keys(["cli"], key_file=path, env_var=API_KEYS_ENV, environ=environ) == (
        "cli", "alpha", "beta", "delta", "epsilon", "zeta")  # all sources together, duplicates dropped
    assert load_keys(env_var=API_KEYS_ENV, environ={}) == ()  # no source at all: an open service
    for bad in ("two words", "caf\u00e9-key", "tab\tkey"):
        with pytest.raises(KeySourceError) as refused:
            load_keys([bad])
        assert bad not in str(refused.value) and "visible ASCII" in str(refused.value)
        with pytest.raises(ValueError, match="never match"):
            BearerKeys([bad])  # a key that could not arrive intact in a header is refused at start-up


def test_finding_5_the_gateway_key_for_its_server_comes_from_one_source(tmp_path):
    path = _key_file(tmp_path, "# the server's key\nserver-key\n")
    environ = {SERVER_API_KEY_ENV: "from-env"}
    assert load_key(None, key_file=path, env_var=SERVER_API_KEY_ENV, environ=environ) == "server-key"
    assert load_key("explicit", env_var=SERVER_API_KEY_ENV, environ=environ) == "explicit"  # options win
    assert load_key(env_var=SERVER_API_KEY_ENV, environ=environ) == "from-env"
    assert load_key(env_var=SERVER_API_KEY_ENV, environ={}) is None
    with pytest.raises(KeySourceError, match="holds 2 keys"):
        load_key(key_file=_key_file(tmp_path, "a\nb\n", name="two"))
    assert "give one of them" in _refusal([*GATEWAY, "--server-api-key", "k", "--server-api-key-file", str(path)])


# --- the shipped systemd unit ------------------------------------------------------------------------------


def _unit(path: Path) -> dict[str, dict[str, list[str]]]:
    """A systemd unit's sections and settings (a setting may repeat); comments dropped."""
    sections: dict[str, dict[str, list[str]]] = {}
    current: dict[str, list[str]] = {}
    for line in path.read_text().replace("\\\n", " ").splitlines():
        line = line.strip()
        if not line or line.startswith(("#", ";")):
            continue
        if line.startswith("["):
            current = sections.setdefault(line.strip("[]"), {})
        else:
            name, _, value = line.partition("=")
            current.setdefault(name.strip(), []).append(value.strip())
    return sections


def test_finding_5_the_systemd_unit_passes_no_key_on_the_command_line():
    service = _unit(ROOT / "deploy" / "privlm-serve.service")["Service"]
    (exec_start,) = service["ExecStart"]
    words = shlex.split(exec_start)
    assert Path(words[0]).name == "privlm" and words[1:3] == ["snd", "serve"]
    assert "--api-key" not in words and not any(word.startswith("--api-key=") for word in words)
    assert "$" not in exec_start  # no variable is expanded into the command line
    key_file = words[words.index("--api-key-file") + 1]
    help_text = runner.invoke(app, ["snd", "serve", "--help"], env={"COLUMNS": "200"}).output
    assert "--api-key-file" in help_text
    snd = typer.main.get_command(app).commands["snd"]
    snd.commands["serve"].make_context("serve", words[3:])  # the real CLI parses it
    # The file is a systemd credential: %d is the service's private credentials directory.
    credentials = dict(entry.split(":", 1) for entry in service.get("LoadCredential", []))
    assert key_file.startswith("%d/") and key_file.removeprefix("%d/") in credentials
    environment = service.get("Environment", []) + service.get("EnvironmentFile", [])
    assert not any("KEY" in entry.upper() for entry in environment)


# --- Authorization by RFC 6750, the same before and after the body is read ----------------------------------

VALID = "k1"
HEADERS = [  # (Authorization values, accepted)
    (["Bearer k1"], True), (["bearer k1"], True), (["BEARER k1"], True), (["bEaReR k1"], True),
    (["Bearer   k1"], True),  # 1*SP
    (["k1"], False),  # a bare key
    (["Basic azE6"], False), (["Basic k1"], False), (["Token k1"], False), (["Bearerk1"], False),
    (["Bearer"], False), (["Bearer k1 k1"], False), (["Bearer\tk1"], False), ([], False),
    (["Bearer k1", "Bearer nope"], False), (["Bearer nope", "Bearer k1"], False),  # two headers: ambiguous
]


@pytest.fixture(scope="module")
def toy_url():
    router = APIRouter()

    @router.post("/echo")
    async def echo(request: Request) -> dict[str, int]:
        return {"bytes": len(await request.body())}

    service = create_service_app(title="toy", routers=[router], auth=BearerKeys([VALID]), max_request_bytes=1 << 20)
    with serving(service) as url:
        yield url


def _status(url: str, request_line: str, values: list[str], body: bytes = b"", *, lines: Sequence[str] = ()) -> int:
    port = int(url.rsplit(":", 1)[1])
    head = [request_line, "host: x", *(f"authorization: {value}" for value in values), *lines,
            *([f"content-length: {len(body)}"] if body else []), "connection: close"]
    with socket.create_connection(("127.0.0.1", port), timeout=10) as sock:
        sock.sendall("\r\n".join(head).encode("latin-1") + b"\r\n\r\n" + body)
        answer = sock.recv(4096)
    return int(re.match(rb"HTTP/1.1 (\d+)", answer).group(1))


@pytest.mark.parametrize(("values", "accepted"), HEADERS, ids=[repr(v) for v, _ in HEADERS])
def test_finding_5_authorization_is_read_by_rfc_6750_on_both_paths(toy_url, values, accepted):
    """GET /metrics meets only the routes' dependency; POST /echo with a body meets the body-limit middleware
    first (``request_key``, before the body is read). Both give the same verdict on every header.
    Before the fix, two Authorization headers split them: the middleware read the last, the routes the first."""
    expected = 200 if accepted else 401
    assert _status(toy_url, "GET /metrics HTTP/1.1", values) == expected
    assert _status(toy_url, "POST /echo HTTP/1.1", values, body=b"abc") == expected
    if len(values) <= 1:
        value = values[0] if values else None
        assert (request_key(bearer_key(value), None) == VALID) is accepted
        assert (bearer_key(value) == VALID) is accepted


API_KEY_LINES = [  # (header lines, accepted): LiteLLM sends its api_key as x-api-key
    (["x-api-key: k1"], True), (["x-api-key:   k1  "], True), (["x-api-key: nope"], False), (["x-api-key:"], False),
    (["x-api-key: k1", "authorization: Bearer k1"], True),  # the same key twice
    (["x-api-key: k1", "authorization: Basic azE6"], True),  # another scheme is no Bearer key: x-api-key's counts
    (["x-api-key: k1", "authorization: Bearer nope"], False), (["x-api-key: nope", "authorization: Bearer k1"], False),
    (["x-api-key: k1", "x-api-key: k1"], False),  # two headers of a kind: ambiguous
]


@pytest.mark.parametrize(("lines", "accepted"), API_KEY_LINES, ids=[repr(v) for v, _ in API_KEY_LINES])
def test_an_x_api_key_header_is_accepted_alike_on_both_paths(toy_url, lines, accepted):
    expected = 200 if accepted else 401
    assert _status(toy_url, "GET /metrics HTTP/1.1", [], lines=lines) == expected
    assert _status(toy_url, "POST /echo HTTP/1.1", [], body=b"abc", lines=lines) == expected


# --- the help text -----------------------------------------------------------------------------------------


def test_finding_10_serve_help_names_the_ray_extra():
    """Rich markup ate ``[ray]``: the help said "needs privlm"."""
    output = runner.invoke(app, ["serve", "--help"], env={"COLUMNS": "200"}).output
    assert "privlm[ray]" in output
