"""SnD's commands: ``privlm snd train`` and ``privlm snd serve`` (``privlm serve``, its alias). Their flags are
the fields of :mod:`privlm.settings.snd`' settings (:mod:`privlm.cli.options`)."""

from __future__ import annotations

import typer

from privlm.cli.options import settings_command
from privlm.cli.root import app, console
from privlm.settings.snd import SndServeSettings, SndTrainSettings

snd_app = typer.Typer(help="Split-N-Denoise: private sentence embeddings.", no_args_is_help=True)
app.add_typer(snd_app, name="snd")


@settings_command(snd_app, "train", SndTrainSettings, env_prefix="PRIVLM_SND_TRAIN")
def snd_train(settings: SndTrainSettings) -> None:
    """Train a denoiser on public text with synthetic d_chi noise."""
    from pathlib import Path

    from privlm.data import public_corpus
    from privlm.models import SplitModel
    from privlm.snd.training import DenoiserTrainer, TrainingConfig

    config = TrainingConfig(eta_min=settings.eta_min, eta_max=settings.eta_max, etas=settings.etas,
                            clip=settings.clip, variant=settings.variant, max_tokens=settings.max_tokens,
                            batch_size=settings.batch_size, learning_rate=settings.learning_rate,
                            max_steps=settings.max_steps, max_minutes=settings.minutes,
                            eval_every=settings.eval_every, patience=settings.patience, seed=settings.seed,
                            model_overrides=settings.model_overrides())
    with console.status("Loading the model and the public corpus..."):
        split_model = SplitModel.from_pretrained(settings.model, device=settings.device)
        texts = public_corpus(sources=list(settings.sources), limit=settings.max_texts, seed=settings.seed)
    out = Path(settings.out)
    trainer = DenoiserTrainer(split_model, texts, config=config, out_dir=out, sources=list(settings.sources),
                              console=console)
    console.print(f"Training on {len(trainer.train_texts)} texts, validating on {len(trainer.val_texts)} "
                  f"({trainer.excluded_long} longer than {settings.max_tokens} tokens left out)")
    card = trainer.train(resume=settings.resume)
    console.print(f"Validation: {card.validation.model_dump()}")
    console.print(f"Wrote {out / 'denoiser.safetensors'} and {out / 'denoiser.json'}")


def serve(settings: SndServeSettings) -> None:
    """The vendor's SnD server: noisy token embeddings in, pooled embeddings out. Never sees text."""
    from privlm.cli.service import exposed

    settings = exposed(settings)
    if settings.ray:
        _serve_with_ray(settings)
        return
    from privlm.cli.service import served_keys
    from privlm.models import SplitModel
    from privlm.service import run_service
    from privlm.snd.service.server import served_app

    split_model = SplitModel.from_pretrained(settings.model, device=settings.device)
    app_ = served_app(split_model, settings, served_keys(settings))
    run_service(app_, host=settings.host, port=settings.port)


settings_command(snd_app, "serve", SndServeSettings, env_prefix="PRIVLM_SND_SERVE", config_file=True)(serve)
settings_command(app, "serve", SndServeSettings, env_prefix="PRIVLM_SND_SERVE", config_file=True)(serve)  # alias


def _serve_with_ray(settings: SndServeSettings) -> None:
    from privlm.cli.service import keys_read_here

    try:
        from privlm.snd.service.ray import run_blocking, snd_application
    except ImportError as error:
        raise typer.BadParameter(str(error), param_hint="--ray") from None
    shared = keys_read_here(settings)
    application = snd_application(shared)
    run_blocking(application, host=settings.host, port=settings.port, name="privlm-snd", address=settings.ray_address)
