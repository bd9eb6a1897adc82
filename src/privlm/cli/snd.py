"""SnD's commands: ``privlm snd train`` and ``privlm snd serve`` (``privlm serve``, its alias); and
the options every service command shares (``privlm gateway`` is in :mod:`privlm.cli.gateway`)."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Annotated, TypeVar

import typer

from privlm.cli.root import app, console, parse_levels, parse_list

if TYPE_CHECKING:
    from privlm.service import ServiceOptions

_Keys = TypeVar("_Keys")

# Options of both services, `privlm serve` and `privlm gateway`.
MaxInFlightOption = Annotated[int, typer.Option(
    "--max-in-flight", help="Requests with a body read or processed at once (a quarter of them per API key); more "
                            "get a 503 (429) to retry. Memory for bodies: about this times the largest request.")]
DocsOption = Annotated[bool, typer.Option("--docs", help="Serve /docs and /redoc (they load scripts from a CDN).")]
# The keys a server (`privlm serve`, `privlm serve-llm`) accepts.
ApiKeyOption = Annotated[list[str] | None, typer.Option(
    "--api-key", help="Accepted Bearer key (repeatable). Other users see it in the process list: prefer "
                      "--api-key-file or $PRIVLM_API_KEYS (commas or newlines). No key from any of them: open.")]
ApiKeyFileOption = Annotated[Path | None, typer.Option(
    "--api-key-file", help="File of accepted Bearer keys, one per line (# comments); refused if every user can "
                           "read it.")]
AllowKeylessOption = Annotated[bool, typer.Option("--allow-keyless", help="Serve without keys on a --host other "
                                                                           "than loopback, to anyone.")]

snd_app = typer.Typer(help="Split-N-Denoise: private sentence embeddings.", no_args_is_help=True)
app.add_typer(snd_app, name="snd")


@snd_app.command("train")
def snd_train(
    out: Annotated[Path, typer.Option(help="Output folder (weights, card, checkpoints).")] = Path("runs/denoiser"),
    model: Annotated[str, typer.Option(help="Base model name or path.")] = "minilm",
    sources: Annotated[str, typer.Option(help="Public corpus sources, comma-separated "
                                              "(wordnet, fortunes, tweets).")] = "wordnet",
    max_texts: Annotated[int, typer.Option(help="Texts drawn from the corpus.")] = 60_000,
    eta_min: Annotated[float, typer.Option(help="Smallest training eta (eta-conditioned model).")] = 10.0,
    eta_max: Annotated[float, typer.Option(help="Largest training eta (eta-conditioned model).")] = 200.0,
    etas: Annotated[str, typer.Option(help="Train on these etas only (one model per eta group), "
                                           "comma-separated; overrides the range.")] = "",
    variant: Annotated[str, typer.Option(help="snd, server (sees e_n and X~ only) or local (e_n zeroed).")] = "snd",
    clip: Annotated[bool, typer.Option(help="Clip noisy embeddings to the vocabulary's max norm.")] = True,
    minutes: Annotated[float, typer.Option(help="Wall-clock budget.")] = 40.0,
    max_steps: Annotated[int, typer.Option(help="Step budget.")] = 100_000,
    batch_size: Annotated[int, typer.Option()] = 32,
    learning_rate: Annotated[float, typer.Option(help="Peak AdamW learning rate.")] = 3e-4,
    max_tokens: Annotated[int, typer.Option(help="Texts longer than this are left out (counted).")] = 64,
    layout: Annotated[str, typer.Option(help="fused (X~_i and Z~_i per row; default) or sequence "
                                             "([e_n; X~; Z~] as in the paper).")] = "fused",
    layers: Annotated[int | None, typer.Option(help="Denoiser layers (default: sized after the paper).")] = None,
    heads: Annotated[int | None, typer.Option(help="Denoiser attention heads.")] = None,
    d_ff: Annotated[int | None, typer.Option(help="Denoiser feed-forward width.")] = None,
    residual: Annotated[bool, typer.Option(help="Add the head's output to e_n (--no-residual: the paper's "
                                                "output at position 0 alone).")] = True,
    readout: Annotated[str, typer.Option(help="e_n (read at e_n's row, the paper) or query (an extra "
                                              "learned row).")] = "e_n",
    eval_every: Annotated[int, typer.Option(help="Validate and checkpoint every N steps.")] = 250,
    patience: Annotated[int, typer.Option(help="Early stop after N evaluations without gain.")] = 6,
    seed: Annotated[int, typer.Option()] = 0,
    resume: Annotated[bool, typer.Option(help="Continue from the checkpoint in --out.")] = False,
    device: Annotated[str, typer.Option(help="auto, cpu or cuda.")] = "auto",
) -> None:
    """Train a denoiser on public text with synthetic d_chi noise."""
    from privlm._validation import check_choice
    from privlm.data import public_corpus
    from privlm.models import SplitModel
    from privlm.snd.denoiser import VARIANTS
    from privlm.snd.training import DenoiserTrainer, TrainingConfig

    source_list = list(parse_list(sources))
    config = TrainingConfig(eta_min=eta_min, eta_max=eta_max, etas=tuple(parse_levels(etas)) if etas else (),
                            clip=clip, variant=check_choice("variant", variant, VARIANTS), max_tokens=max_tokens,
                            batch_size=batch_size,
                            learning_rate=learning_rate,
                            max_steps=max_steps, max_minutes=minutes, eval_every=eval_every, patience=patience,
                            seed=seed, model_overrides={"layout": layout, "residual": residual, "readout": readout} | {
                                k: v for k, v in (("n_layers", layers), ("n_heads", heads), ("d_ff", d_ff))
                                if v is not None})
    with console.status("Loading the model and the public corpus..."):
        split_model = SplitModel.from_pretrained(model, device=device)
        texts = public_corpus(sources=source_list, limit=max_texts, seed=seed)
    trainer = DenoiserTrainer(split_model, texts, config=config, out_dir=out, sources=source_list, console=console)
    console.print(f"Training on {len(trainer.train_texts)} texts, validating on {len(trainer.val_texts)} "
                  f"({trainer.excluded_long} longer than {max_tokens} tokens left out)")
    card = trainer.train(resume=resume)
    console.print(f"Validation: {card.validation.model_dump()}")
    console.print(f"Wrote {out / 'denoiser.safetensors'} and {out / 'denoiser.json'}")


@snd_app.command("serve")
def serve(
    model: Annotated[str, typer.Option(help="Model name or path.")] = "minilm",
    host: Annotated[str, typer.Option()] = "127.0.0.1",
    port: Annotated[int, typer.Option()] = 8000,
    api_key: ApiKeyOption = None,
    api_key_file: ApiKeyFileOption = None,
    denoiser: Annotated[list[Path] | None, typer.Option(help="Denoiser folders to offer (default: shipped).")] = None,
    max_batch_rows: Annotated[int, typer.Option(help="Micro-batch size bound (sentences).")] = 64,
    max_wait_ms: Annotated[float, typer.Option(help="Micro-batch wait bound.")] = 5.0,
    device: Annotated[str, typer.Option(help="auto, cpu or cuda.")] = "auto",
    ray: Annotated[bool, typer.Option("--ray", help="Serve through Ray Serve (needs privlm\\[ray]).")] = False,
    replicas: Annotated[int, typer.Option(help="With --ray: number of replicas.")] = 1,
    replica_cpus: Annotated[float, typer.Option(help="With --ray: CPUs reserved per replica.")] = 1.0,
    ray_address: Annotated[str | None, typer.Option(help="With --ray: join this cluster (default: start one).")] = None,
    max_in_flight: MaxInFlightOption = 32,
    docs: DocsOption = False,
    allow_keyless: AllowKeylessOption = False,
) -> None:
    """The vendor's SnD server: noisy token embeddings in, pooled embeddings out. Never sees text."""
    from privlm.service.auth import API_KEYS_ENV

    keys = _load_keys(api_key, api_key_file, API_KEYS_ENV)
    service = _service_options(host=host, keys=keys, allow_keyless=allow_keyless, docs=docs,
                               max_in_flight=max_in_flight)
    if ray:
        # The replicas read the key file themselves: its keys are not handed to Ray, which stores arguments.
        passed = _load_keys(api_key, None, API_KEYS_ENV)
        _serve_with_ray(model=model, host=host, port=port, api_keys=passed,
                        api_key_file=api_key_file.resolve() if api_key_file else None, denoiser_dirs=denoiser,
                        max_batch_rows=max_batch_rows, max_wait_ms=max_wait_ms, device=device, replicas=replicas,
                        replica_cpus=replica_cpus, address=ray_address, service=service)
        return
    from privlm.models import SplitModel
    from privlm.service import run_service
    from privlm.snd.service.server import create_app

    split_model = SplitModel.from_pretrained(model, device=device)
    app_ = create_app(split_model, denoiser_dirs=denoiser or None, api_keys=keys,
                      max_batch_rows=max_batch_rows, max_wait_ms=max_wait_ms, **service)
    run_service(app_, host=host, port=port)


app.command("serve", help="The same as `privlm snd serve` (kept as an alias): the vendor's SnD server.")(serve)


def _serve_with_ray(*, model: str, host: str, port: int, api_keys: list[str] | tuple[str, ...],
                    api_key_file: Path | None, denoiser_dirs: list[Path] | None, max_batch_rows: int,
                    max_wait_ms: float, device: str,
                    replicas: int, replica_cpus: float, address: str | None, service: ServiceOptions) -> None:
    try:
        from privlm.snd.service.ray import run_blocking, snd_application
    except ImportError as error:
        raise typer.BadParameter(str(error), param_hint="--ray") from None
    application = snd_application(model, replicas=replicas, replica_cpus=replica_cpus, denoiser_dirs=denoiser_dirs,
                                  api_keys=api_keys, api_key_file=api_key_file, max_batch_rows=max_batch_rows,
                                  max_wait_ms=max_wait_ms, device=device,
                                  service=service)
    run_blocking(application, host=host, port=port, name="privlm-snd", address=address)


def _service_options(*, host: str, keys: tuple[str, ...], allow_keyless: bool, docs: bool,
                     max_in_flight: int | None = None) -> ServiceOptions:
    """The app's options from the flags. A service without keys bound beyond loopback is refused unless
    ``--allow-keyless``; with it, the service answers any ``Host`` (its loopback-only check would refuse
    every remote caller)."""
    from privlm.service import ServiceOptions
    from privlm.service.hosts import ANY_HOST, is_loopback

    options = ServiceOptions(docs=docs)
    if max_in_flight is not None:
        if max_in_flight < 1:
            raise typer.BadParameter(f"must be >= 1, got {max_in_flight}", param_hint="--max-in-flight")
        options["max_in_flight"] = max_in_flight
    if not keys and not is_loopback(host):
        if not allow_keyless:
            raise typer.BadParameter(
                f"{host} is reachable from other machines and no API key is set, so anyone who reaches it could "
                "use the service. Give keys (--api-key-file, the environment variable or --api-key), bind to "
                "127.0.0.1, or pass --allow-keyless to serve it open on purpose.", param_hint="--host")
        typer.echo(f"Warning: serving without API keys on {host} (--allow-keyless): anyone who reaches it can use "
                   "it.", err=True)
        options["allowed_hosts"] = [ANY_HOST]
    return options


def _load_keys(keys: list[str] | None, key_file: Path | None, env_var: str) -> tuple[str, ...]:
    """The accepted keys from the command line, a file and ``env_var``; a bad source is a usage error."""
    from privlm.service.auth import load_keys

    return _keys_or_usage_error(lambda: load_keys(keys or (), key_file=key_file, env_var=env_var))


def _load_server_key(key: str | None, key_file: Path | None) -> str | None:
    from privlm.service.auth import SERVER_API_KEY_ENV, load_key

    return _keys_or_usage_error(lambda: load_key(key, key_file=key_file, env_var=SERVER_API_KEY_ENV))


def _keys_or_usage_error(load: Callable[[], _Keys]) -> _Keys:
    """``load()``, with a key source's error as a usage error (no traceback) and its warnings on stderr."""
    import warnings

    from privlm.service.auth import KeySourceError

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        try:
            loaded = load()
        except KeySourceError as error:
            raise typer.BadParameter(error.problem, param_hint=error.source) from None
    for warning in caught:
        typer.echo(f"Warning: {warning.message}", err=True)
    return loaded
