"""Sweep ``snd``: Split-N-Denoise against its baselines and ablations at calibrated etas.

Levels: the etas at which nearest-neighbour inversion of the model's token embeddings succeeds
about 50%, 10%, 1% and 0.1% of the time (measured first, on WordNet tokens).
Per (method, eta, task):
  - utility: probe accuracy and AUC (train -> early stop on validation -> test once);
    cosine and MSE between private and clean test embeddings;
  - privacy of what the server receives: nearest-neighbour inversion rate, attribute inference
    (a classifier on mean-pooled privatized token embeddings predicting the task label), and the
    Kozachenko-Leonenko estimate of I(X; X~) over distinct tokens.
The local-only model sends nothing to the server: its attack columns are the no-information level.

The denoiser methods that send clipped X~ (SnD and its ablations) draw the same noise at each
(eta, task): a paired comparison, and the server's forward pass on that X~ runs once, not once per
method (memoised by the bytes of X~ and the mask).
"""

from __future__ import annotations

import hashlib
import math
import zlib
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import torch

from privlm.attacks import attribute_inference, mutual_information, nearest_neighbour_inversion, undo_clip_scale
from privlm.baselines import Text2Text, TokEmbPriv
from privlm.baselines.common import text_positions
from privlm.eval.bench import Point, Sweep
from privlm.eval.data import Splits, named_task, public_corpus, split_dataset
from privlm.eval.probes import embedding_agreement, evaluate_probe
from privlm.mechanisms import make_generator, sample_dchi_noise
from privlm.models import SplitModel
from privlm.snd.artefacts import default_denoiser_dir, read_card
from privlm.snd.calibration import calibrate_eta, sample_text_tokens
from privlm.snd.encoder import PlainEncoder, SnDEncoder
from privlm.snd.privatizer import SnDPrivatizer

SPLITS = ("train", "validation", "test")
CALIBRATION_GRID = tuple(float(x) for x in np.geomspace(10, 300, 16).round(2))
TARGET_RATES = (0.5, 0.1, 0.01, 0.001)
# Optional ablation denoisers, sub-folders of --denoisers, all trained at one budget (see
# benchmarks/snd/train_denoisers.sh); snd/ there is SnD at that same budget, for a fair comparison.
ABLATIONS = {"SnD, ablation budget": "snd", "SnD, no clip": "noclip", "server-side denoiser": "server",
             "local-only model": "local", "SnD, no e_n residual": "noresidual",
             "SnD, query readout": "query"}
GROUPS = "SnD, one denoiser per eta group"
# Methods that release clipped X~ through SnDEncoder: they share one noise draw per (eta, task).
SHARED_CLIPPED_RELEASE = frozenset({"SnD", "SnD, ablation budget", "server-side denoiser", "local-only model",
                                    "SnD, no e_n residual", "SnD, query readout", GROUPS})


def resolve_method_names(parts: Sequence[str], available: Sequence[str]) -> list[str]:
    """Comma-split pieces back into method names, longest match first ("SnD, no clip" is one name)."""
    pieces, names, i = [p.strip() for p in parts if p.strip()], [], 0
    while i < len(pieces):
        for j in range(len(pieces), i, -1):
            if ", ".join(pieces[i:j]) in available:
                names.append(", ".join(pieces[i:j]))
                i = j
                break
        else:
            raise ValueError(f"method {pieces[i]!r} is not available; available: {sorted(available)}")
    return names


@dataclass
class SnDSetting:
    model: str = "minilm"
    tasks: tuple[str, ...] = ("tweets-binary", "fortunes")
    n_train: int = 2000
    n_validation: int = 500
    n_test: int = 1000
    attack_sentences: int = 200
    calibration_tokens: int = 20_000
    probe: str = "mlp"
    seed: int = 0
    device: str = "auto"
    denoisers: str = ""  # folder with the ablation denoisers (noclip/, server/, local/, groups/*)
    etas: tuple[float, ...] = ()  # empty: calibrate
    methods: tuple[str, ...] = ()  # empty: all available
    calibration: dict[str, object] = field(default_factory=dict)


class SnDSweep:
    def __init__(self, setting: SnDSetting) -> None:
        self.setting = setting
        self.model = SplitModel.from_pretrained(setting.model, device=setting.device)
        self.splits: dict[str, Splits] = {}
        self.clean: dict[str, dict[str, np.ndarray]] = {}
        for task in setting.tasks:
            self.splits[task] = split_dataset(named_task(task), seed=setting.seed).head(
                train=setting.n_train, validation=setting.n_validation, test=setting.n_test)
            self.clean[task] = {s: self.model.encode_texts(self._texts(task, s)).numpy() for s in SPLITS}
        self.encoders = self._available_methods()
        self._privacy_cache: dict[tuple[str, float, str], dict[str, float]] = {}
        self._server_outputs: dict[str, torch.Tensor] = {}

    # --- levels -------------------------------------------------------------------------------
    def calibrate(self) -> list[float]:
        texts = public_corpus(sources=("wordnet",), limit=20_000, seed=self.setting.seed)
        tokens = sample_text_tokens(self.model, texts, n_tokens=self.setting.calibration_tokens,
                                    seed=self.setting.seed)
        calibration = calibrate_eta(self.model, tokens, etas=CALIBRATION_GRID, targets=TARGET_RATES,
                                    seed=self.setting.seed)
        self.setting.calibration = {"grid": calibration.grid,
                                    "eta_for_inversion_rate": {str(k): v for k, v in calibration.targets.items()}}
        return [round(v, 1) for v in calibration.targets.values() if math.isfinite(v)]

    # --- methods --------------------------------------------------------------------------------
    def _available_methods(self) -> dict[str, Callable[[float, torch.Generator], object]]:
        root = Path(self.setting.denoisers) if self.setting.denoisers else None
        methods: dict[str, Callable[[float, torch.Generator], object]] = {}
        if (default_denoiser_dir(self.setting.model) / "denoiser.json").exists():
            methods["SnD"] = self._with_denoiser("default")
        methods["TokEmbPriv"] = lambda eta, g: TokEmbPriv(self.model, eta=eta, generator=g)
        methods["Text2Text"] = lambda eta, g: Text2Text(self.model, eta=eta, generator=g)
        if root is not None:
            for name, folder in ABLATIONS.items():
                if (root / folder / "denoiser.json").exists():
                    methods[name] = self._with_denoiser(root / folder)
            groups = sorted(p.parent for p in (root / "groups").glob("*/denoiser.json"))
            if groups:
                methods[GROUPS] = lambda eta, g: SnDEncoder(self.model, eta=eta, generator=g,
                                                            denoiser=self._group_for(groups, eta),
                                                            server=self._memoised_server)
        if self.setting.methods:
            methods = {m: methods[m] for m in resolve_method_names(self.setting.methods, list(methods))}
        return methods

    def _with_denoiser(self, folder: Path | str) -> Callable[[float, torch.Generator], SnDEncoder]:
        return lambda eta, g: SnDEncoder(self.model, eta=eta, generator=g, denoiser=folder,
                                         server=self._memoised_server)

    @torch.inference_mode()
    def _memoised_server(self, noisy: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
        digest = hashlib.sha256()
        for tensor in (noisy, attention_mask):
            digest.update(str((tensor.dtype, tuple(tensor.shape))).encode())
            digest.update(tensor.detach().cpu().contiguous().numpy().tobytes())
        key = digest.hexdigest()
        if key not in self._server_outputs:
            self._server_outputs[key] = self.model.encode(noisy, attention_mask)
        return self._server_outputs[key].clone()

    @staticmethod
    def _group_for(groups: Sequence[Path], eta: float) -> Path:
        """The group whose training etas bracket eta, else the nearest in log-eta."""
        def distance(folder: Path) -> float:
            low, high = read_card(folder)["eta_range"]
            return 0.0 if low <= eta <= high else min(abs(math.log(eta / low)), abs(math.log(eta / high)))
        return min(groups, key=distance)

    # --- evaluation -------------------------------------------------------------------------------
    def _texts(self, task: str, split: str) -> list[str]:
        return list(getattr(self.splits[task], split).texts)

    def _labels(self, task: str, split: str) -> np.ndarray:
        return np.asarray(getattr(self.splits[task], split).labels)

    def _generator(self, *parts: object) -> torch.Generator:
        key = "/".join(str(p) for p in parts)
        return make_generator(zlib.crc32(key.encode()) ^ self.setting.seed, device=self.model.device)

    def evaluate(self, point: Point) -> dict[str, float]:
        task = point.task
        if math.isinf(point.level):
            encoder: object = PlainEncoder(self.model)
        else:
            stream = "clipped release" if point.method in SHARED_CLIPPED_RELEASE else point.method
            encoder = self.encoders[point.method](point.level, self._generator(stream, point.level, task))
        embeddings = {s: encoder.encode(self._texts(task, s)) for s in SPLITS}  # type: ignore[attr-defined]
        probe = evaluate_probe(*[(embeddings[s], self._labels(task, s)) for s in SPLITS],
                               kind=self.setting.probe, seed=self.setting.seed)
        agreement = embedding_agreement(self.clean[task]["test"], embeddings["test"])
        metrics = {"auc": probe.auc, "accuracy": probe.accuracy, "validation_auc": probe.validation_auc,
                   "cosine_to_clean": agreement["cosine"], "mse_to_clean": agreement["mse"]}
        return metrics | self._privacy(point)

    def _privacy(self, point: Point) -> dict[str, float]:
        """What the server receives, attacked. Cached per (kind of release, eta, task)."""
        if point.method == "local-only model":
            return {"attack_success": 0.0, "attribute_inference": math.nan, "attribute_chance": math.nan,
                    "mutual_information": 0.0, "sent_to_server": 0.0}
        if math.isinf(point.level):
            kind = "clean"
        elif point.method == "Text2Text":
            kind = "text2text"
        elif point.method in ("TokEmbPriv", "SnD, no clip"):  # both send unclipped X + Z
            kind = "unclipped"
        else:
            kind = "clipped"
        key = (kind, point.level, point.task)
        if key not in self._privacy_cache:
            self._privacy_cache[key] = self._attack(kind, point.level, point.task)
        return self._privacy_cache[key] | {"sent_to_server": 1.0}

    @torch.inference_mode()
    def _release(self, kind: str, eta: float, texts: Sequence[str], generator: torch.Generator
                 ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        """(what the server sees as token vectors, true ids, user-text mask, attention mask)."""
        batch = self.model.tokenize(texts)
        clean = self.model.embed_tokens(batch.input_ids)
        if kind == "clean":
            return clean, batch.input_ids, text_positions(self.model, batch), batch.attention_mask
        if kind == "text2text":
            released = Text2Text(self.model, eta=eta, generator=generator).privatize(texts)
            return (self.model.embed_tokens(released.released_ids), batch.input_ids, released.perturbed,
                    batch.attention_mask)
        privatizer = SnDPrivatizer(self.model, eta=eta, clip=kind == "clipped", generator=generator)
        noisy, _ = privatizer.privatize_embeddings(clean, batch.attention_mask)
        return noisy, batch.input_ids, text_positions(self.model, batch), batch.attention_mask

    def _pooled_release(self, kind: str, eta: float, task: str, split: str) -> np.ndarray:
        texts, rows = self._texts(task, split), []
        generator = self._generator("attribute", kind, eta, task, split)
        for start in range(0, len(texts), 128):
            vectors, _, _, mask = self._release(kind, eta, texts[start:start + 128], generator)
            weights = mask.unsqueeze(-1).to(vectors.dtype)
            rows.append(((vectors * weights).sum(1) / weights.sum(1)).cpu().numpy())
        return np.concatenate(rows)

    @torch.inference_mode()
    def _attack(self, kind: str, eta: float, task: str) -> dict[str, float]:
        generator = self._generator("attack", kind, eta, task)
        texts = self._texts(task, "test")[: self.setting.attack_sentences]
        vectors, ids, user_text, _ = self._release(kind, eta, texts, generator)
        # For Text2Text the vectors are rows of released ids: the attack succeeds iff the id was kept.
        inversion = nearest_neighbour_inversion(vectors, ids, self.model.embedding_matrix, mask=user_text)
        if kind == "clipped":  # the attacker knows eta and C: undo the clip's scale with the expected norm
            unclipped = undo_clip_scale(vectors, eta=eta, clip_norm=self.model.max_embedding_norm,
                                        vocabulary=self.model.embedding_matrix)
            rescaled = nearest_neighbour_inversion(unclipped, ids, self.model.embedding_matrix, mask=user_text)
            inversion = max(inversion, rescaled, key=lambda r: r.rate)
        attribute = attribute_inference(self._pooled_release(kind, eta, task, "train"), self._labels(task, "train"),
                                        self._pooled_release(kind, eta, task, "test"), self._labels(task, "test"),
                                        seed=self.setting.seed)
        return {"attack_success": inversion.rate, "attack_ci_low": inversion.ci_low,
                "attack_ci_high": inversion.ci_high, "attribute_inference": attribute.rate,
                "attribute_chance": attribute.chance if attribute.chance is not None else math.nan,
                "mutual_information": self._mutual_information(kind, eta, ids[user_text])}

    def _mutual_information(self, kind: str, eta: float, token_ids: torch.Tensor) -> float:
        """KL estimate of I(X; X + Z) over distinct tokens. Clipping is post-processing, so for the clipped
        release this is an upper bound (estimating on the clipped vectors breaks the estimator: they lie on
        a sphere)."""
        if kind not in ("clipped", "unclipped"):
            return math.nan
        clean = self.model.embed_tokens(token_ids)
        noise = sample_dchi_noise(clean.shape, eta=eta, generator=self._generator("mi", eta),
                                  device=clean.device, dtype=clean.dtype)
        return mutual_information(clean + noise, noise, token_ids=token_ids).mean


def snd_sweep(setting: SnDSetting | None = None) -> Sweep:
    setting = setting or SnDSetting()
    state = SnDSweep(setting)
    etas = list(setting.etas) or state.calibrate()
    return Sweep(
        name="snd",
        description=("Split-N-Denoise vs TokEmbPriv, Text2Text and ablations on "
                     f"{setting.model} at etas calibrated to nearest-neighbour inversion rates "
                     f"{', '.join(f'{r:.1%}' for r in TARGET_RATES)}. Utility: test AUC of a probe ({setting.probe}) "
                     "trained on train embeddings and early-stopped on validation; privacy: attacks on what the "
                     "server receives."),
        methods=list(state.encoders), levels=etas, tasks=list(setting.tasks), evaluate=state.evaluate,
        references=[Point("non-private", math.inf, task) for task in setting.tasks],
        settings=setting.__dict__.copy(),
    )
