"""Split-N-Denoise: private sentence embeddings with a client-side denoiser.

The core (card, denoiser, privatizer, encoder, training) does no I/O; the HTTP clients and the errors of a
remote server come from :mod:`privlm.snd.service`."""

from privlm.snd.artefacts import default_denoiser_dir, load_denoiser, save_denoiser
from privlm.snd.card import DenoiserCard, read_card, write_card
from privlm.snd.denoiser import Denoiser, DenoiserConfig
from privlm.snd.encoder import BaseEncoder, Encoded, EncodeReport, EncoderOptions, PlainEncoder, SnDEncoder
from privlm.snd.privatizer import PrivateBatch, SnDPrivatizer
from privlm.snd.service.client import (
    AsyncClient,
    BaseClient,
    Client,
    ClientOptions,
    IncompleteEncodingError,
    ModelChangedError,
    ServerError,
)

__all__ = [
    "AsyncClient",
    "BaseClient",
    "BaseEncoder",
    "Client",
    "ClientOptions",
    "Denoiser",
    "DenoiserCard",
    "DenoiserConfig",
    "EncodeReport",
    "Encoded",
    "EncoderOptions",
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
