"""Issue 37, items 4 and 10: ``privlm gateway`` refusing to start says why, in one line, and writes nothing.

- Item 4: with memory on, the memory made a fresh secret where the ledger's lost secret had been before the ledger
  checked it; the start was still refused, but the message blamed the new file. The ledger checks first now.
- Item 10: a memory file that is not a SQLite database printed a 99-line traceback (exit status 1).

The command runs in this process on a tiny random device model (no packaged model loads); it is refused while
the gateway is built, before it would serve.
"""

from __future__ import annotations

from pathlib import Path

import pytest
from typer.testing import CliRunner, Result

from privlm.accounting import Ledger
from privlm.accounting.principals import secret_path_of
from privlm.cape import LogitBound
from privlm.mechanisms import PrivacyUnit, Spend
from privlm.service.auth import KEY_ENV_VARS
from tests.models.tiny import tiny_masked_lm_folder
from tests.support.chat import B

KEY = "team-key-1"
runner = CliRunner()


@pytest.fixture(scope="module")
def device_flags(tmp_path_factory: pytest.TempPathFactory) -> list[str]:
    """The flags of a chat gateway on a tiny random device model (and a logit bound of its own)."""
    from privlm.models.language import LanguageModel

    folder = tiny_masked_lm_folder(tmp_path_factory.mktemp("round3-device") / "model")
    fingerprint = LanguageModel.from_pretrained(folder, device="cpu").weights_fingerprint
    bound = LogitBound(value=B, model_fingerprint=fingerprint).save(folder.parent / "logit_bound.json")
    return ["gateway", "--chat-upstream", "http://127.0.0.1:9/v1", "--chat-model", "stub-model", "--epsilon", "6",
            "--logit-bound", str(bound), "--device-model", str(folder), "--device", "cpu"]


def start(args: list[str], monkeypatch: pytest.MonkeyPatch) -> Result:
    """``privlm ARGS`` in this process; a gateway that would start serving fails the test instead of hanging it."""
    from privlm.cli import app

    def serving(*_: object, **__: object) -> None:
        raise AssertionError("the gateway started; it should have been refused")

    monkeypatch.setattr("privlm.service.run_service", serving)
    # No key from the environment; a wide terminal, so that the usage error's message is one line of its box.
    return runner.invoke(app, args, env={**dict.fromkeys(KEY_ENV_VARS), "COLUMNS": "500"})


def refusal(result: Result) -> str:
    """The usage error's message: exit status 2, no traceback, one line."""
    assert result.exit_code == 2 and isinstance(result.exception, SystemExit), (result.exception, result.output)
    assert "Traceback" not in result.output
    [line] = [line for line in result.output.splitlines() if "Invalid value" in line]
    return " ".join(line.replace("│", " ").split())


def test_round3_4_a_lost_ledger_secret_is_named_at_start_and_no_new_secret_is_written(device_flags, postgres_url,
                                                                                     tmp_path, monkeypatch):
    secret = tmp_path / "ledger.secret"
    ledger = Ledger(postgres_url, budgets={PrivacyUnit.EPSILON: 100.0}, secret=secret)
    ledger.spend(ledger.principal_of_key(KEY), Spend(PrivacyUnit.EPSILON, 1.0))  # the ledger has its secret now
    secret.unlink()  # lost
    result = start([*device_flags, "--chat-budget", "100", "--chat-ledger", postgres_url, "--chat-ledger-secret",
                    str(secret), "--api-key", KEY], monkeypatch)  # --chat-memory auto: in the ledger's database
    message = refusal(result)
    assert "which is gone" in message and str(secret) in message, message  # the real cause
    assert not secret.exists()  # nothing made a new secret in its place


def test_round3_10_a_memory_file_that_is_not_a_database_is_one_line_naming_it(device_flags, tmp_path, monkeypatch):
    memory = tmp_path / "chat.memory"
    memory.write_bytes(bytes(range(256)) * 16)  # not a SQLite file
    result = start([*device_flags, "--chat-memory", str(memory)], monkeypatch)
    message = refusal(result)
    assert f"the conversation memory: {memory} is not a SQLite database" in message, message
    assert memory.read_bytes() == bytes(range(256)) * 16 and not secret_path_of(memory).exists()  # left as it was
    assert sorted(path.name for path in Path(tmp_path).iterdir()) == ["chat.memory"]


def test_round3_10_a_ledger_file_that_is_not_a_database_is_one_line_naming_it(device_flags, tmp_path, monkeypatch):
    ledger = tmp_path / "chat.ledger"
    ledger.write_bytes(bytes(range(256)) * 16)
    result = start([*device_flags, "--chat-budget", "100", "--chat-ledger", str(ledger), "--chat-memory", "off"],
                   monkeypatch)
    message = refusal(result)
    assert f"{ledger} is not a SQLite database" in message, message
    assert ledger.read_bytes() == bytes(range(256)) * 16
