import math

import pytest
from rich.console import Console

from privlm.models import SplitModel
from privlm.snd.encoder import EncoderOptions
from privlm_bench.harness.bench import run_sweep
from privlm_bench.snd.sweep import SnDSetting, snd_sweep
from tests.models.tiny import tiny_bert_folder, train_tiny_denoiser

QUIET = Console(quiet=True)
BATCH = EncoderOptions().batch_size


@pytest.mark.slow
def test_snd_sweep_runs_end_to_end_on_a_tiny_model(tmp_path):
    folder = tiny_bert_folder(tmp_path / "model")
    model = SplitModel.from_pretrained(folder, device="cpu")
    for variant in ("snd", "server", "local"):
        train_tiny_denoiser(model, tmp_path / "denoisers" / variant, variant=variant)
    setting = SnDSetting(model=str(folder), tasks=("tweets-binary",), n_train=60, n_validation=30, n_test=40,
                         attack_sentences=10, probe="logistic", device="cpu", etas=(5.0,),
                         denoisers=str(tmp_path / "denoisers"))
    sweep = snd_sweep(setting)
    # No default denoiser ships for the tiny model, so SnD appears only at the ablation budget.
    assert [m.key for m in sweep.methods] == ["tokembpriv", "text2text", "snd-ablation-budget", "server-side",
                                              "local-only"]
    report = run_sweep(sweep, out_dir=tmp_path / "out", seed=0, console=QUIET)
    # SnD and the server-side denoiser draw the same X~, so the server runs once per batch, not twice.
    batches = sum(math.ceil(n / BATCH) for n in (60, 30, 40))
    assert len(sweep.evaluate.__self__._server_outputs) == batches
    rows = {row["method"]: row for row in report.rows}
    assert rows["non-private"]["attack_success"] == 1.0 and math.isinf(rows["non-private"]["eta"])
    assert rows["local-only"]["sent_to_server"] == 0.0
    for row in report.rows:
        assert 0.0 <= row["auc"] <= 1.0 and "attribute_inference" in row
    assert (tmp_path / "out" / "privacy_utility_tweets-binary.png").exists()


def test_methods_are_chosen_by_key(tmp_path):
    folder = tiny_bert_folder(tmp_path / "model")
    setting = SnDSetting(model=str(folder), tasks=("tweets-binary",), n_train=20, n_validation=10, n_test=10,
                         probe="logistic", device="cpu", etas=(5.0,), methods=("text2text", "tokembpriv"))
    assert [m.key for m in snd_sweep(setting).methods] == ["text2text", "tokembpriv"]
    with pytest.raises(ValueError, match=r"\['SnD, no clip'\] are not available; available: tokembpriv \(TokEmbPriv\)"):
        snd_sweep(SnDSetting(model=str(folder), tasks=("tweets-binary",), n_train=20, n_validation=10, n_test=10,
                             device="cpu", etas=(5.0,), methods=("SnD, no clip",)))
