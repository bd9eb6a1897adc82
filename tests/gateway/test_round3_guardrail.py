"""Issue 37 (harden round 3), items 8 and 9, through ``privlm gateway``'s flags: ``--guardrail-deadline`` reaches the
guardrail route, and ``--restore`` with ``--guardrail`` is taken (the chat route restores) but said at start not to
apply to the guardrail, which never sees an answer to restore.

The command runs with CliRunner up to the point where it would serve (``_serve_in_process``, recorded instead: no
model loads, no upstream is asked).
"""

from __future__ import annotations

from typing import Any

import httpx
import pytest
from typer.testing import CliRunner

from privlm.chat.service.upstream import ChatUpstream
from privlm.gateway import ChatSetup, create_privacy_gateway
from privlm.settings.chat import ChatOptions
from privlm.settings.gateway import GatewaySettings
from tests.chat.test_round3_guardrail import Held, held_privacy
from tests.service.localhost import serving
from tests.support import litellm
from tests.support.chat import TIMEOUT

GUARDRAIL = "/beta/litellm_basic_guardrail_api"
UPSTREAM = "http://127.0.0.1:9/v1"  # never asked: the command stops where it would serve
RESTORE_WARNING = ("Warning: --restore applies to /v1/chat/completions only: the guardrail (--guardrail) does not "
                   "restore")
runner = CliRunner()


@pytest.fixture
def started(monkeypatch: pytest.MonkeyPatch) -> list[GatewaySettings]:
    """The settings ``privlm gateway`` would serve, once it has said what it says at start."""
    import privlm.cli.gateway

    served: list[GatewaySettings] = []
    monkeypatch.setattr(privlm.cli.gateway, "_serve_in_process", lambda settings, **where: served.append(settings))
    return served


def gateway(*flags: str) -> Any:
    from privlm.cli import app  # imported on use: the CLI registers every command at import

    return runner.invoke(app, ["gateway", "--chat-upstream", UPSTREAM, "--epsilon", "6", "--logit-bound", "b.json",
                               *flags])


def test_round3_9_restore_with_the_guardrail_says_at_start_that_the_guardrail_does_not_restore(started):
    """On main the pair was taken silently. The gateway serves the chat route beside the guardrail, where restore
    applies, so the pair is kept, with one warning line on stderr at start."""
    result = gateway("--restore", "--guardrail")
    assert result.exit_code == 0, (result.output, result.exception)
    warnings = [line for line in result.stderr.splitlines() if line.startswith("Warning:")]
    assert len(warnings) == 1 and warnings[0].startswith(RESTORE_WARNING), result.stderr
    [settings] = started
    assert settings.chat is not None and settings.chat.restore and settings.chat.guardrail


@pytest.mark.parametrize("flags", [["--restore", "--no-guardrail"], ["--no-restore", "--guardrail"]])
def test_restore_or_the_guardrail_alone_starts_without_that_warning(started, flags):  # a guard, not a finding
    result = gateway(*flags)
    assert result.exit_code == 0 and RESTORE_WARNING not in result.stderr, (result.output, result.exception)


def test_round3_8_the_gateway_flag_sets_the_guardrail_deadline(stub, started):
    """``--guardrail-deadline 0.5`` reaches the settings, and the gateway built with it BLOCKS a request still waiting
    for a held device model at that deadline, naming it."""
    result = gateway("--guardrail", "--guardrail-deadline", "0.5")
    assert result.exit_code == 0, (result.output, result.exception)
    [settings] = started
    assert settings.chat is not None and settings.chat.guardrail_deadline == 0.5

    held = Held()
    setup = ChatSetup(privacy=held_privacy(held), upstream=ChatUpstream(stub.url),
                      options=ChatOptions(guardrail=True, guardrail_deadline=settings.chat.guardrail_deadline))
    with serving(create_privacy_gateway(chat=setup)) as url, httpx.Client(base_url=url, timeout=TIMEOUT) as http:
        try:
            answer = http.post(GUARDRAIL, json=litellm.body(["Alice lives in Paris"]), headers=litellm.headers())
            assert held.entered.is_set() and not held.release.is_set()  # answered while the model was held
        finally:
            held.release.set()  # before the server stops: it waits for the device model's thread
    assert answer.status_code == 200 and answer.json()["action"] == "BLOCKED", answer.text
    assert "deadline (0.5 s)" in answer.json()["blocked_reason"]


@pytest.mark.parametrize("bad", ["0", "-1", "inf", "nan"])
def test_round3_8_a_bad_guardrail_deadline_is_a_usage_error_naming_the_flag(started, bad):
    result = gateway("--guardrail", "--guardrail-deadline", bad)
    output = " ".join(result.output.replace("│", " ").split())
    assert result.exit_code == 2 and "--guardrail-deadline" in output and "must be finite and > 0" in output, output
    assert started == []
