"""The detector's training options, declared once: :class:`TrainSettings` (``privlm detect train``, and what
:func:`privlm.detect.training.train_tagger` reads)."""

from __future__ import annotations

from dataclasses import dataclass

from privlm.settings.options import check_fields, option
from privlm.settings.service import DEVICES

__all__ = ["TrainSettings"]


@dataclass(frozen=True)
class TrainSettings:
    """Training the tagger on synthetic data from the committed generator; thresholds chosen on validation."""

    out: str = option("runs/detect-tagger", help="Folder for tagger.safetensors and tagger.json (the package ships "
                                                 "src/privlm/detect/data).")
    train_examples: int = option(20_000, minimum=1, help="Synthetic training examples.")
    validation_examples: int = option(3_000, minimum=1, help="Examples the thresholds are chosen on.")
    test_examples: int = option(3_000, minimum=1, help="Examples scored once, after everything is chosen (unseen "
                                                       "templates and values).")
    negatives: int = option(30_000, minimum=0, help="Public texts (WordNet, fortunes, tweets) drawn as filler and "
                                                    "negatives.")
    epochs: int = option(6, minimum=1, help="Passes over the training examples.")
    learning_rate: float = option(2e-3, positive=True, help="AdamW's learning rate.")
    batch_tokens: int = option(4096, minimum=1, help="Tokens per training step.")
    beta: float = option(2.0, positive=True, help="Thresholds maximise token F-beta: recall weighs beta² times "
                                                  "precision.")
    seed: int = option(20261129, minimum=0, help="Seed of the generator, the draw of negatives and training.")
    hold_out: tuple[str, ...] = option((), help="A file of values never to draw, one a line (names: each part too); "
                                       "repeatable. The shipped tagger held out benchmarks/detect/held-out-values.txt.")
    device: str = option("auto", choices=DEVICES, help="auto, cpu or cuda.")

    def __post_init__(self) -> None:
        check_fields(self)
