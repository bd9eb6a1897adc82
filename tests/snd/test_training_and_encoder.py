import json
import warnings

import numpy as np
import pytest
import torch
from rich.console import Console

from privlm.mechanisms import make_generator
from privlm.snd import EncoderOptions, SnDEncoder, load_denoiser, read_card
from privlm.snd.training import DenoiserTrainer, TrainingConfig
from tests.models.tiny import tiny_model
from tests.snd.conftest import TEXTS

QUIET = Console(quiet=True)


def _config(**overrides) -> TrainingConfig:
    base = dict(eta_min=2.0, eta_max=20.0, max_tokens=16, batch_size=16, max_steps=6, max_minutes=5.0, eval_every=3,
                n_validation=40, seed=1, learning_rate=1e-3, model_overrides={"n_heads": 4, "d_ff": 64,
                                                                               "n_layers": 1})
    return TrainingConfig(**(base | overrides))


@pytest.fixture(scope="module")
def trained(tiny_bert, corpus, tmp_path_factory):
    out = tmp_path_factory.mktemp("denoiser")
    card = DenoiserTrainer(tiny_bert, corpus, config=_config(), out_dir=out, sources=["toy"], console=QUIET).train()
    return out, card


def test_training_writes_weights_and_a_complete_card(trained, tiny_bert):
    out, card = trained
    assert (out / "denoiser.safetensors").exists()
    assert read_card(out) == card  # the card written is the card read back
    assert json.loads((out / "denoiser.json").read_text())["format"] == "privlm-denoiser/2"
    assert card.base_model.fingerprint == tiny_bert.fingerprint
    assert card.eta_range == (2.0, 20.0)
    assert card.training_data.sources == ["toy"] and card.training_data.n_validation == 40
    assert card.training.steps == 6 and card.training.wall_seconds > 0
    assert 0 < card.validation.cosine <= 1 and card.validation.noisy_mse > 0
    assert card.provenance["command"] and card.provenance["git_commit"]
    assert [h["step"] for h in card.history] == [3, 6]
    assert "pickle" not in (out / "denoiser.safetensors").read_bytes()[:200].decode(errors="replace")


def test_resume_continues_from_the_checkpoint(tiny_bert, corpus, tmp_path):
    DenoiserTrainer(tiny_bert, corpus, config=_config(max_steps=3), out_dir=tmp_path, console=QUIET).train()
    assert json.loads((tmp_path / "checkpoint.json").read_text())["state"]["step"] == 3
    with pytest.raises(ValueError, match="different settings"):
        DenoiserTrainer(tiny_bert, corpus, config=_config(max_steps=6, learning_rate=0.5), out_dir=tmp_path,
                        console=QUIET).train(resume=True)
    card = DenoiserTrainer(tiny_bert, corpus, config=_config(max_steps=6), out_dir=tmp_path,  # more budget, same run
                           console=QUIET).train(resume=True)
    assert card.training.steps == 6
    assert [h["step"] for h in card.history] == [3, 6]


def test_training_lowers_the_validation_loss(tiny_bert, corpus, tmp_path):
    card = DenoiserTrainer(tiny_bert, corpus, config=_config(max_steps=40, eval_every=20, eta_min=20.0, eta_max=50.0),
                           out_dir=tmp_path, console=QUIET).train()
    first, last = card.history[0], card.history[-1]
    assert last["loss"] < first["loss"] or last["cosine"] > card.validation.noisy_cosine
    assert card.validation.cosine > card.validation.noisy_cosine


def test_encoder_is_a_drop_in_and_reports(trained, tiny_bert):
    out, _ = trained
    encoder = SnDEncoder(tiny_bert, eta=5.0, denoiser=out, generator=make_generator(0))
    encoded = encoder.encode_with_report(TEXTS, batch_size=2)
    assert encoded.vectors.shape == (len(TEXTS), 32) and encoded.vectors.dtype == np.float32
    assert encoded.report.texts == len(TEXTS) and encoded.report.truncated == 0
    assert encoded.report.server_calls == 3 and encoded.report.receipt is None  # no ledger, nothing recorded
    assert encoded.report.tokens == sum(tiny_bert.token_counts(TEXTS))


def test_encoder_order_matches_single_calls(tiny_bert):
    encoder = SnDEncoder(tiny_bert, eta=1e7, denoiser=None)  # negligible noise: rows of different texts stay apart
    batch = encoder.encode(TEXTS, batch_size=2)  # length-sorted batches, returned in input order
    singles = np.concatenate([encoder.encode([t]) for t in TEXTS])
    distances = ((batch[:, None, :] - singles[None, :, :]) ** 2).sum(-1)
    assert distances.argmin(axis=1).tolist() == list(range(len(TEXTS)))


def test_denoiser_for_another_model_is_refused(trained):
    from privlm.models import SplitModel

    out, _ = trained
    other = SplitModel(tiny_model("distilbert"), device="cpu")
    with pytest.raises(ValueError, match="trained for base model"):
        load_denoiser(out, model=other)


def test_eta_outside_the_trained_range_warns(trained, tiny_bert):
    out, _ = trained
    with pytest.warns(UserWarning, match=r"outside the range \[2, 20\]"):
        SnDEncoder(tiny_bert, eta=500.0, denoiser=out)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        SnDEncoder(tiny_bert, eta=10.0, denoiser=out)


def test_bad_inputs_get_clear_errors(trained, tiny_bert):
    out, _ = trained
    for eta in (0, -1.0, float("nan"), float("inf")):
        with pytest.raises(ValueError, match="eta"):
            SnDEncoder(tiny_bert, eta=eta, denoiser=out)
    encoder = SnDEncoder(tiny_bert, eta=5.0, denoiser=out)
    for bad in ([], ["fine", ""], "a string"):
        with pytest.raises(ValueError, match="texts"):
            encoder.encode(bad)
    with pytest.raises(ValueError, match="no default denoiser"):
        SnDEncoder(tiny_bert, eta=5.0)


def test_over_long_texts_warn_with_a_count_or_raise(trained, tiny_bert):
    out, _ = trained
    long_text = " ".join(["cat"] * 200)
    encoder = SnDEncoder(tiny_bert, eta=5.0, denoiser=out)
    with pytest.warns(UserWarning, match=r"1 of 2 texts are longer than max_length=64 tokens \(indices \[1\]\)"):
        encoded = encoder.encode_with_report(["a dog", long_text])
    assert encoded.vectors.shape[0] == 2 and encoded.report.truncated == 1
    assert encoded.report.truncated_indices == [1]
    strict = SnDEncoder(tiny_bert, eta=5.0, denoiser=out, options=EncoderOptions(truncation="error"))
    with pytest.raises(ValueError, match="longer than max_length"):
        strict.encode(["a dog", long_text])
    assert strict.encode_with_report(["a dog", long_text], truncation="count").report.truncated == 1  # no warning
    with pytest.raises(ValueError, match="truncation"):
        strict.encode_with_report(["a dog"], truncation="sometimes")


def test_local_only_variant_never_calls_the_server(tiny_bert, corpus, tmp_path):
    DenoiserTrainer(tiny_bert, corpus, config=_config(variant="local", max_steps=3), out_dir=tmp_path,
                    console=QUIET).train()
    encoder = SnDEncoder(tiny_bert, eta=5.0, denoiser=tmp_path)
    assert encoder.variant == "local" and encoder.encode_with_report(TEXTS).report.server_calls == 0


def test_training_draws_every_random_number_on_the_models_device(tiny_bert, corpus, tmp_path, monkeypatch):
    """Every generator of a training run is asked for on the model's device (a CPU generator for CUDA noise
    made `privlm snd train --device cuda` fail at its first step)."""
    from privlm.snd import training
    from privlm.snd.training import sample_etas

    devices = []
    real = training.make_generator

    def recording(seed=None, *, device=None):  # None: the caller did not say where
        devices.append(device)
        return real(seed, device=device or "cpu")

    monkeypatch.setattr(training, "make_generator", recording)
    trainer = DenoiserTrainer(tiny_bert, corpus, config=_config(max_steps=1), out_dir=tmp_path, console=QUIET)
    trainer.val_targets = trainer._targets(trainer.val_texts)
    trainer.validate()  # makes the validation stream
    assert devices == [tiny_bert.device, tiny_bert.device]  # the training stream and the validation stream
    assert trainer.generator.device == tiny_bert.device
    assert sample_etas(trainer.config, 4, trainer.generator).device == tiny_bert.device
    assert sample_etas(_config(etas=(5.0, 10.0)), 4, trainer.generator).device == tiny_bert.device


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_training_and_encoding_run_on_cuda(corpus, tmp_path):
    """`privlm snd train --device cuda` used to fail at its first step (a CPU generator for CUDA noise)."""
    from privlm.models import SplitModel
    from tests.models.tiny import tiny_bert_folder

    model = SplitModel.from_pretrained(tiny_bert_folder(tmp_path / "model"), device="cuda")
    card = DenoiserTrainer(model, corpus, config=_config(max_steps=2, eval_every=2), out_dir=tmp_path / "d",
                           console=QUIET).train()
    assert card.training.steps == 2
    assert SnDEncoder(model, eta=5.0, denoiser=tmp_path / "d").encode(TEXTS).shape == (len(TEXTS), 32)


def test_concurrent_calls_keep_their_own_reports(trained, tiny_bert):
    """One encoder, many threads: each call's report describes that call only."""
    from concurrent.futures import ThreadPoolExecutor

    out, _ = trained
    encoder = SnDEncoder(tiny_bert, eta=5.0, denoiser=out)
    batches = [TEXTS[: 1 + i % len(TEXTS)] for i in range(24)]
    with ThreadPoolExecutor(6) as pool:
        results = list(pool.map(lambda texts: encoder.encode_with_report(texts, batch_size=2), batches))
    for texts, encoded in zip(batches, results, strict=True):
        assert encoded.report.texts == len(texts) and encoded.vectors.shape == (len(texts), 32)
        assert encoded.report.tokens == sum(tiny_bert.token_counts(texts))
        assert encoded.report.server_calls == -(-len(texts) // 2)


def test_any_iterable_of_texts_is_accepted(tiny_bert):
    encoder = SnDEncoder(tiny_bert, eta=1e7, denoiser=None, generator=make_generator(1))
    reference = SnDEncoder(tiny_bert, eta=1e7, denoiser=None, generator=make_generator(1)).encode(list(TEXTS))
    np.testing.assert_allclose(encoder.encode(np.array(TEXTS)), reference, atol=1e-6)
    assert encoder.encode(text for text in TEXTS).shape == reference.shape
