"""Split-N-Denoise: private sentence embeddings with a client-side denoiser."""

from privlm.snd.artefacts import default_denoiser_dir, load_denoiser, read_card, save_denoiser
from privlm.snd.client import AsyncClient, Client, ServerError
from privlm.snd.denoiser import Denoiser, DenoiserConfig
from privlm.snd.encoder import EncodeReport, PlainEncoder, SnDEncoder
from privlm.snd.privatizer import PrivateBatch, SnDPrivatizer

__all__ = [
    "AsyncClient",
    "Client",
    "Denoiser",
    "DenoiserConfig",
    "EncodeReport",
    "PlainEncoder",
    "PrivateBatch",
    "ServerError",
    "SnDEncoder",
    "SnDPrivatizer",
    "default_denoiser_dir",
    "load_denoiser",
    "read_card",
    "save_denoiser",
]
