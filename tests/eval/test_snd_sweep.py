import math

from rich.console import Console

from privlm.eval.bench import run_sweep
from privlm.eval.sweeps.snd import SnDSetting, snd_sweep
from privlm.models import SplitModel
from privlm.snd.training import DenoiserTrainer, TrainingConfig
from tests.models.tiny import tiny_bert_folder

QUIET = Console(quiet=True)


def _train(model: SplitModel, texts: list[str], out, variant: str) -> None:
    config = TrainingConfig(eta_min=2.0, eta_max=20.0, max_tokens=16, batch_size=8, max_steps=2, eval_every=2,
                            n_validation=20, variant=variant,
                            model_overrides={"n_heads": 4, "d_ff": 64, "n_layers": 1})
    DenoiserTrainer(model, texts, config=config, out_dir=out, console=QUIET).train()


def test_snd_sweep_runs_end_to_end_on_a_tiny_model(tmp_path):
    folder = tiny_bert_folder(tmp_path / "model")
    model = SplitModel.from_pretrained(folder, device="cpu")
    texts = [f"the cat sat on the mat {i}" for i in range(80)]
    for variant, name in (("snd", "snd"), ("local", "local")):
        _train(model, texts, tmp_path / "denoisers" / name, variant)
    setting = SnDSetting(model=str(folder), tasks=("tweets-binary",), n_train=60, n_validation=30, n_test=40,
                         attack_sentences=10, probe="logistic", device="cpu", etas=(5.0,),
                         denoisers=str(tmp_path / "denoisers"))
    sweep = snd_sweep(setting)
    # No default denoiser ships for the tiny model, so SnD appears only at the ablation budget.
    assert list(sweep.methods) == ["TokEmbPriv", "Text2Text", "SnD, ablation budget", "local-only model"]
    report = run_sweep(sweep, out_dir=tmp_path / "out", seed=0, console=QUIET)
    rows = {row["method"]: row for row in report.rows}
    assert rows["non-private"]["attack_success"] == 1.0 and math.isinf(rows["non-private"]["eta"])
    assert rows["local-only model"]["sent_to_server"] == 0.0
    for row in report.rows:
        assert 0.0 <= row["auc"] <= 1.0 and "attribute_inference" in row
    assert (tmp_path / "out" / "privacy_utility_tweets-binary.png").exists()
