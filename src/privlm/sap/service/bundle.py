"""What a SAP customer downloads from the vendor: the bottom model at one split position and the tokenizer.

``GET /v1/sap/bottoms/<blocks>`` is the manifest (``wire.BottomManifest``: sha256 per file, the bottom's
fingerprint); ``GET /v1/sap/bottoms/<blocks>/files/<name>`` the files: ``bottom.safetensors`` (the bottom's
weights only), ``bottom.json`` (the model config, with no filesystem path, and the fingerprint) and
``tokenizer/<file>``.
The top never leaves the vendor.
"""

from __future__ import annotations

import json
import tempfile
from pathlib import Path, PurePosixPath

from transformers import AutoTokenizer, PreTrainedTokenizerBase

from privlm.models.partition import BOTTOM_CONFIG, BOTTOM_WEIGHTS, BottomModel, load_bottom
from privlm.sap.service.wire import BUNDLE_FORMAT, BottomFacts
from privlm.service import Bundle, ServerError, check_file_name, public_config, public_model_name


def is_bottom_bundle_file(name: str) -> bool:
    """Whether a bottom bundle may hold ``name``: the two bottom files and ``tokenizer/<file>``."""
    try:
        parts = PurePosixPath(check_file_name(name)).parts
    except ServerError:
        return False
    return parts in ((BOTTOM_WEIGHTS,), (BOTTOM_CONFIG,)) or (len(parts) == 2 and parts[0] == "tokenizer")


def bottom_bundle(bottom: BottomModel, tokenizer: PreTrainedTokenizerBase) -> Bundle:
    """The bundle for one split position; ``fingerprint`` is what the customer's session request must name."""
    config = bottom.config
    public = config.model_dump() | {"model_name": public_model_name(config.model_name),
                                    "model_config": public_config(config.transformers_config)}
    facts = BottomFacts(blocks=config.blocks, total_blocks=config.total_blocks, fingerprint=config.fingerprint,
                        model=public["model_name"], hidden_size=config.hidden_size, vocab_size=config.vocab_size)
    bundle = Bundle(format=BUNDLE_FORMAT, facts=facts.model_dump())
    with tempfile.TemporaryDirectory() as folder:
        bottom.save(folder)
        bundle.add(BOTTOM_WEIGHTS, (Path(folder) / BOTTOM_WEIGHTS).read_bytes())
        bundle.add(BOTTOM_CONFIG, json.dumps(public, indent=1, sort_keys=True).encode())
    with tempfile.TemporaryDirectory() as folder:
        tokenizer.save_pretrained(folder)
        for path in sorted(Path(folder).iterdir()):
            bundle.add(f"tokenizer/{path.name}", path.read_bytes())
    return bundle


def load_bottom_bundle(folder: Path, fingerprint: str) -> tuple[BottomModel, PreTrainedTokenizerBase]:
    """The customer's bottom and tokenizer from a downloaded bundle, checked against the manifest's fingerprint."""
    try:
        bottom = load_bottom(folder, expected_fingerprint=fingerprint)
    except ValueError as error:
        raise ServerError(f"the downloaded bottom does not check out: {error}") from error
    return bottom, AutoTokenizer.from_pretrained(folder / "tokenizer", local_files_only=True)
