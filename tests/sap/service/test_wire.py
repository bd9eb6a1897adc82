"""The JSON the SAP vendor and its client exchange: one set of models, strict on read on both sides."""

from __future__ import annotations

import pytest
from pydantic import ValidationError

from privlm.sap import LoraSettings, SapConfig
from privlm.sap.service.bundle import bottom_bundle
from privlm.sap.service.wire import BottomManifest, SessionInfo, SessionRequest

INFO = {"id": "sap-" + "0" * 32, "blocks": 0, "n_classes": 2, "head": "customer", "trainable_bottom": False,
        "steps_done": 3, "checkpoint_step": 2, "uploaded_examples": 8}


def test_the_manifest_the_server_writes_is_the_one_the_client_reads(make_parts):  # type: ignore[no-untyped-def]
    parts = make_parts(SapConfig(blocks=1))
    manifest = bottom_bundle(parts.bottom, parts.tokenizer).manifest()
    read = BottomManifest.model_validate(manifest)
    assert read.model_dump() == manifest and read.fingerprint == parts.bottom.config.fingerprint
    for change in ({"surprise": 1}, {"blocks": -1}, {"format": "privlm-sap-bottom-bundle/2"},
                   {"fingerprint": "not hex"}, {"files": []}, {"hidden_size": "32"}):
        with pytest.raises(ValidationError):
            BottomManifest.model_validate(manifest | change)


def test_a_session_request_carries_the_config_and_its_answer_is_checked():
    config = SapConfig(blocks=1, head="customer", learning_rate=0.01, seed=4, lora=LoraSettings(rank=4, dropout=0.1))
    request = SessionRequest.for_config(config, n_classes=3, bottom_fingerprint="a" * 64)
    assert request.lora_settings() == config.lora
    assert SessionRequest.model_validate(request.model_dump()) == request
    assert SessionInfo.model_validate_json(SessionInfo(**INFO).model_dump_json()) == SessionInfo(**INFO)
    for change in ({"steps_done": -1}, {"id": "sap-x"}, {"head": "middle"}, {"surprise": 1}, {"n_classes": 1}):
        with pytest.raises(ValidationError):
            SessionInfo.model_validate(INFO | change)
