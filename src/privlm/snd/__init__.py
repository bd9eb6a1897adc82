"""Split-N-Denoise: private sentence embeddings with a client-side denoiser."""

from privlm.service import ServerError
from privlm.snd.artefacts import default_denoiser_dir, load_denoiser, save_denoiser
from privlm.snd.card import DenoiserCard, read_card, write_card
from privlm.snd.denoiser import Denoiser, DenoiserConfig
from privlm.snd.encoder import (
    Encoded,
    EncodeReport,
    IncompleteEncodingError,
    ModelChangedError,
    PlainEncoder,
    SnDEncoder,
)
from privlm.snd.privatizer import PrivateBatch, SnDPrivatizer
from privlm.snd.service.client import AsyncClient, Client

__all__ = [
    "AsyncClient",
    "Client",
    "Denoiser",
    "DenoiserCard",
    "DenoiserConfig",
    "EncodeReport",
    "Encoded",
    "IncompleteEncodingError",
    "ModelChangedError",
    "PlainEncoder",
    "PrivateBatch",
    "ServerError",
    "SnDEncoder",
    "SnDPrivatizer",
    "default_denoiser_dir",
    "load_denoiser",
    "read_card",
    "save_denoiser",
    "write_card",
]
