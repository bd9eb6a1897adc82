"""Fixtures of the accounting tests: the gateway tests' ``stub`` upstream (tests/gateway/conftest.py), for the
ledger-principal tests that call a gateway."""

from tests.gateway.conftest import stub  # noqa: F401 - registered as a fixture of this folder

