"""What names a model's weights: sha256 digests that two processes compare (cards, manifests, answer headers)."""

from __future__ import annotations

import hashlib
import json

import torch

# Architecture fields that define a model's shape (whichever of them a config has). Loader-added
# fields (dtype, attention implementation, paths, versions) are left out so the hash is stable.
_ARCHITECTURE_KEYS = ("model_type", "vocab_size", "hidden_size", "n_embd", "d_model", "dim", "num_hidden_layers",
                      "n_layer", "num_layers", "n_layers", "num_attention_heads", "n_head", "num_heads",
                      "n_heads", "intermediate_size", "n_inner", "d_ff", "hidden_dim", "max_position_embeddings",
                      "n_positions", "type_vocab_size", "tie_word_embeddings")


def model_fingerprint(embedding_matrix: torch.Tensor, config: dict[str, object]) -> str:
    """sha256 of the embedding matrix (fp32 bytes) and the architecture fields of the config."""
    digest = hashlib.sha256()
    digest.update(embedding_matrix.detach().float().cpu().contiguous().numpy().tobytes())
    architecture = {k: config[k] for k in _ARCHITECTURE_KEYS if k in config}
    digest.update(json.dumps(architecture, sort_keys=True, default=str).encode())
    return digest.hexdigest()


def weights_sha256(module: torch.nn.Module, *, salt: bytes = b"") -> str:
    """sha256 of ``salt`` (what else the weights' owner computes with), then every parameter and persistent
    buffer (name, then fp32 bytes, a quantized one dequantized), in name order. Packed non-tensor state is skipped."""
    digest = hashlib.sha256(salt)
    for name, tensor in sorted(module.state_dict().items()):
        if not isinstance(tensor, torch.Tensor):
            continue
        digest.update(name.encode())
        value = tensor.dequantize() if tensor.is_quantized else tensor
        digest.update(value.detach().float().cpu().contiguous().numpy().tobytes())
    return digest.hexdigest()
