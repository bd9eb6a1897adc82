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
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Literal

import numpy as np
import torch

from privlm.attacks import attribute_inference, mutual_information, nearest_neighbour_inversion, undo_clip_scale
from privlm.baselines import Text2Text, TokEmbPriv
from privlm.baselines.common import text_positions
from privlm.mechanisms import sample_dchi_noise
from privlm.snd import PlainEncoder, SnDEncoder, SnDPrivatizer, default_denoiser_dir, read_card
from privlm_bench.data import public_corpus
from privlm_bench.harness.bench import NON_PRIVATE, Method, Point, Sweep
from privlm_bench.harness.embedding import SPLITS, TEXT2TEXT, TOKEMBPRIV, EmbeddingSetting, EmbeddingSweep
from privlm_bench.snd.calibration import calibrate_eta, sample_text_tokens

CALIBRATION_GRID = tuple(float(x) for x in np.geomspace(10, 300, 16).round(2))
TARGET_RATES = (0.5, 0.1, 0.01, 0.001)
# Methods that release clipped X~ through SnDEncoder share one noise stream per (eta, task).
SHARED = "clipped release"
SND = Method("snd", "SnD", SHARED)
ABLATION_BUDGET = Method("snd-ablation-budget", "SnD, ablation budget", SHARED)
NO_CLIP = Method("snd-no-clip", "SnD, no clip")
SERVER_SIDE = Method("server-side", "server-side denoiser", SHARED)
LOCAL_ONLY = Method("local-only", "local-only model", SHARED)
NO_RESIDUAL = Method("snd-no-residual", "SnD, no e_n residual", SHARED)
QUERY_READOUT = Method("snd-query-readout", "SnD, query readout", SHARED)
ETA_GROUPS = Method("snd-eta-groups", "SnD, one denoiser per eta group", SHARED)
# Optional ablation denoisers, sub-folders of --denoisers, all trained at one budget (see
# benchmarks/snd/train_denoisers.sh); snd/ there is SnD at that same budget, for a fair comparison.
ABLATIONS = {ABLATION_BUDGET: "snd", NO_CLIP: "noclip", SERVER_SIDE: "server", LOCAL_ONLY: "local",
             NO_RESIDUAL: "noresidual", QUERY_READOUT: "query"}
METHODS = (SND, TOKEMBPRIV, TEXT2TEXT, *ABLATIONS, ETA_GROUPS)


Release = Literal["clean", "text2text", "unclipped", "clipped"]  # what the server receives, for the attacks
EncoderFactory = Callable[[float, torch.Generator], SnDEncoder | TokEmbPriv | Text2Text]


@dataclass(kw_only=True)
class SnDSetting(EmbeddingSetting):
    tasks: tuple[str, ...] = ("tweets-binary", "fortunes")
    attack_sentences: int = 200
    calibration_tokens: int = 20_000
    denoisers: str = ""  # folder with the ablation denoisers (noclip/, server/, local/, groups/*)
    etas: tuple[float, ...] = ()  # empty: calibrate
    methods: tuple[str, ...] = ()  # method keys; empty: all available
    calibration: dict[str, object] = field(default_factory=dict)


class SnDSweep(EmbeddingSweep):
    def __init__(self, setting: SnDSetting) -> None:
        super().__init__(setting)
        self.setting: SnDSetting = setting
        self.encoders = self._available_methods()
        self._privacy_cache: dict[tuple[Release, float, str], dict[str, float]] = {}
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
    def _available_methods(self) -> dict[Method, EncoderFactory]:
        root = Path(self.setting.denoisers) if self.setting.denoisers else None
        methods: dict[Method, EncoderFactory] = {}
        if (default_denoiser_dir(self.setting.model) / "denoiser.json").exists():
            methods[SND] = self._with_denoiser("default")
        methods[TOKEMBPRIV] = lambda eta, g: TokEmbPriv(self.model, eta=eta, generator=g)
        methods[TEXT2TEXT] = lambda eta, g: Text2Text(self.model, eta=eta, generator=g)
        if root is not None:
            for method, folder in ABLATIONS.items():
                if (root / folder / "denoiser.json").exists():
                    methods[method] = self._with_denoiser(root / folder)
            groups = sorted(p.parent for p in (root / "groups").glob("*/denoiser.json"))
            if groups:
                methods[ETA_GROUPS] = lambda eta, g: SnDEncoder(self.model, eta=eta, generator=g,
                                                                denoiser=self._group_for(groups, eta),
                                                                server=self._memoised_server)
        if self.setting.methods:
            by_key = {m.key: m for m in methods}
            unknown = [k for k in self.setting.methods if k not in by_key]
            if unknown:
                raise ValueError(f"methods {unknown} are not available; available: "
                                 + ", ".join(f"{m.key} ({m.label})" for m in methods))
            methods = {by_key[k]: methods[by_key[k]] for k in self.setting.methods}
        return methods

    def _with_denoiser(self, folder: Path | str) -> EncoderFactory:
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
            low, high = read_card(folder).eta_range
            return 0.0 if low <= eta <= high else min(abs(math.log(eta / low)), abs(math.log(eta / high)))
        return min(groups, key=distance)

    # --- evaluation -------------------------------------------------------------------------------
    def evaluate(self, point: Point) -> dict[str, float]:
        task = point.task
        encoder: PlainEncoder | SnDEncoder | TokEmbPriv | Text2Text
        if math.isinf(point.level):
            encoder = PlainEncoder(self.model)
        else:
            method = next(m for m in self.encoders if m.key == point.method)
            encoder = self.encoders[method](point.level, self.generator(method.stream, point.level, task))
        embeddings = {s: encoder.encode(self.texts(task, s)) for s in SPLITS}
        return self.utility(task, embeddings) | self._privacy(point)

    def _privacy(self, point: Point) -> dict[str, float]:
        """What the server receives, attacked. Cached per (kind of release, eta, task)."""
        if point.method == LOCAL_ONLY.key:
            return {"attack_success": 0.0, "attribute_inference": math.nan, "attribute_chance": math.nan,
                    "mutual_information": 0.0, "sent_to_server": 0.0}
        kind: Release
        if math.isinf(point.level):
            kind = "clean"
        elif point.method == TEXT2TEXT.key:
            kind = "text2text"
        elif point.method in (TOKEMBPRIV.key, NO_CLIP.key):  # both send unclipped X + Z
            kind = "unclipped"
        else:
            kind = "clipped"
        key = (kind, point.level, point.task)
        if key not in self._privacy_cache:
            self._privacy_cache[key] = self._attack(kind, point.level, point.task)
        return self._privacy_cache[key] | {"sent_to_server": 1.0}

    @torch.inference_mode()
    def _release(self, kind: Release, eta: float, texts: Sequence[str], generator: torch.Generator
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
        privatizer = SnDPrivatizer(self.model, eta=eta, clip=kind == "clipped")
        noisy, _ = privatizer.privatize_embeddings(clean, batch.attention_mask, generator=generator)
        return noisy, batch.input_ids, text_positions(self.model, batch), batch.attention_mask

    def _pooled_release(self, kind: Release, eta: float, task: str, split: str) -> np.ndarray:
        texts, rows = self.texts(task, split), []
        generator = self.generator("attribute", kind, eta, task, split)
        for start in range(0, len(texts), 128):
            vectors, _, _, mask = self._release(kind, eta, texts[start:start + 128], generator)
            weights = mask.unsqueeze(-1).to(vectors.dtype)
            rows.append(((vectors * weights).sum(1) / weights.sum(1)).cpu().numpy())
        return np.concatenate(rows)

    @torch.inference_mode()
    def _attack(self, kind: Release, eta: float, task: str) -> dict[str, float]:
        generator = self.generator("attack", kind, eta, task)
        texts = self.attack_texts(task)
        vectors, ids, user_text, _ = self._release(kind, eta, texts, generator)
        # For Text2Text the vectors are rows of released ids: the attack succeeds iff the id was kept.
        inversion = nearest_neighbour_inversion(vectors, ids, self.model.embedding_matrix, mask=user_text)
        if kind == "clipped":  # the attacker knows eta and C: undo the clip's scale with the expected norm
            unclipped = undo_clip_scale(vectors, eta=eta, clip_norm=self.model.max_embedding_norm,
                                        vocabulary=self.model.embedding_matrix)
            rescaled = nearest_neighbour_inversion(unclipped, ids, self.model.embedding_matrix, mask=user_text)
            inversion = max(inversion, rescaled, key=lambda r: r.rate)
        attribute = attribute_inference(self._pooled_release(kind, eta, task, "train"), self.labels(task, "train"),
                                        self._pooled_release(kind, eta, task, "test"), self.labels(task, "test"),
                                        seed=self.setting.seed)
        return {"attack_success": inversion.rate, "attack_ci_low": inversion.ci_low,
                "attack_ci_high": inversion.ci_high, "attribute_inference": attribute.rate,
                "attribute_chance": attribute.chance if attribute.chance is not None else math.nan,
                "mutual_information": self._mutual_information(kind, eta, ids[user_text])}

    def _mutual_information(self, kind: Release, eta: float, token_ids: torch.Tensor) -> float:
        """KL estimate of I(X; X + Z) over distinct tokens. Clipping is post-processing, so for the clipped
        release this is an upper bound (estimating on the clipped vectors breaks the estimator: they lie on
        a sphere)."""
        if kind not in ("clipped", "unclipped"):
            return math.nan
        clean = self.model.embed_tokens(token_ids)
        noise = sample_dchi_noise(clean.shape, eta=eta, generator=self.generator("mi", eta),
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
        references=[Point(NON_PRIVATE.key, math.inf, task) for task in setting.tasks],
        settings=setting.__dict__.copy(),
    )
