"""Training a denoiser on public text (``privlm snd train``).

Per step: draw a batch of texts and one eta per text; X = token embeddings; X~, Z~ = clipped
d_chi privatization at that eta; e_c = G(X) (cached once per text), e_n = G(X~); minimise
||D(e_n, X~, Z~) - e_c||^2 + w_cos * (1 - cos(D(...), e_c)). Validation uses fixed noise, so
its loss is comparable across evaluations; early stopping and the kept weights follow it.
Checkpoints (safetensors + JSON, never pickle) make a run resumable.
"""

from __future__ import annotations

import json
import logging
import math
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path

import numpy as np
import torch
from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn
from safetensors.torch import load_file, save_file

from privlm.mechanisms import make_generator
from privlm.models import SplitModel
from privlm.models.batching import length_sorted_batches
from privlm.provenance import provenance
from privlm.snd.artefacts import base_model_facts, save_denoiser
from privlm.snd.card import DenoiserCard, TrainingData, TrainingRecord, ValidationFigures
from privlm.snd.denoiser import Denoiser, DenoiserConfig, Variant
from privlm.snd.privatizer import SnDPrivatizer

log = logging.getLogger(__name__)


@dataclass(kw_only=True)
class TrainingConfig:
    eta_min: float = 10.0
    eta_max: float = 200.0
    etas: tuple[float, ...] = ()  # discrete training etas (one model per eta group); empty: log-uniform range
    clip: bool = True
    variant: Variant = "snd"
    max_tokens: int = 64
    batch_size: int = 32
    learning_rate: float = 3e-4
    weight_decay: float = 0.01
    cosine_weight: float = 1.0
    max_steps: int = 100_000
    max_minutes: float = 40.0
    eval_every: int = 250
    patience: int = 6
    n_validation: int = 512
    seed: int = 0
    model_overrides: dict[str, object] = field(default_factory=dict)


@dataclass
class TrainingState:
    step: int = 0
    epoch: int = 0
    position: int = 0
    best_loss: float = math.inf
    best_step: int = 0
    evals_since_best: int = 0
    seconds: float = 0.0
    history: list[dict[str, float]] = field(default_factory=list)


def sample_etas(config: TrainingConfig, n: int, generator: torch.Generator) -> torch.Tensor:
    """Training etas, on the generator's device: drawn from ``etas`` uniformly, or log-uniform on [eta_min, eta_max]."""
    device = generator.device
    if config.etas:
        choices = torch.tensor(config.etas, dtype=torch.float32, device=device)
        return choices[torch.randint(len(choices), (n,), generator=generator, device=device)]
    u = torch.rand(n, generator=generator, device=device)
    return torch.exp(math.log(config.eta_min) + u * (math.log(config.eta_max) - math.log(config.eta_min)))


def loss_terms(denoised: torch.Tensor, target: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-sentence squared error (summed over dims) and cosine."""
    return (denoised - target).pow(2).sum(-1), torch.nn.functional.cosine_similarity(denoised, target, dim=-1)


class DenoiserTrainer:
    def __init__(self, model: SplitModel, texts: Sequence[str], *, config: TrainingConfig, out_dir: Path,
                 sources: Sequence[str] = (), console: Console | None = None) -> None:
        self.model, self.config, self.out_dir = model, config, Path(out_dir)
        self.console = console or Console()
        self.sources = list(sources)
        self.train_texts, self.val_texts, self.excluded_long = self._prepare_texts(texts)
        overrides = {"eta_min": min(config.etas or (config.eta_min,)), "eta_max": max(config.etas or (config.eta_max,)),
                     "variant": config.variant, **config.model_overrides}
        self.denoiser = Denoiser(DenoiserConfig.for_model(model.hidden_size, **overrides)).to(model.device)
        self.optimiser = torch.optim.AdamW(self.denoiser.parameters(), lr=config.learning_rate,
                                           weight_decay=config.weight_decay)
        self.generator = make_generator(config.seed, device=model.device)  # noise is drawn where the model runs
        self.state = TrainingState()
        self.permutation = self._shuffle()

    # --- data ---------------------------------------------------------------------------------
    def _prepare_texts(self, texts: Sequence[str]) -> tuple[list[str], list[str], int]:
        """Drop texts longer than max_tokens (counted, never truncated) and hold out a validation set."""
        counts = self.model.token_counts(texts)
        kept = [t for t, n in zip(texts, counts, strict=True) if n <= self.config.max_tokens]
        if len(kept) <= self.config.n_validation:
            raise ValueError(f"only {len(kept)} texts fit in max_tokens={self.config.max_tokens}; "
                             f"need more than n_validation={self.config.n_validation}")
        order = np.random.default_rng(self.config.seed).permutation(len(kept))
        val = [kept[i] for i in order[: self.config.n_validation]]
        train = [kept[i] for i in order[self.config.n_validation:]]
        return train, val, len(texts) - len(kept)

    @torch.inference_mode()
    def _targets(self, texts: Sequence[str]) -> torch.Tensor:
        return self.model.encode_texts(texts, batch_size=128).to(self.model.device)

    def _batch(self, texts: Sequence[str], targets: torch.Tensor, eta: torch.Tensor, generator: torch.Generator
               ) -> tuple[torch.Tensor, ...]:
        with torch.inference_mode():
            batch = self.model.tokenize(texts, max_length=self.config.max_tokens)
            clean = self.model.embed_tokens(batch.input_ids)
            privatizer = SnDPrivatizer(self.model, eta=eta.to(clean), clip=self.config.clip)  # one eta per sentence
            noisy, noise = privatizer.privatize_embeddings(clean, batch.attention_mask, generator=generator)
            e_n = self.model.encode(noisy, batch.attention_mask)
        # Inference tensors cannot enter autograd; clones can.
        mask = batch.attention_mask.clone()
        return e_n.clone(), noisy.clone(), noise.clone(), mask, eta.to(self.model.device), targets

    # --- loop -----------------------------------------------------------------------------------
    def validate(self) -> dict[str, float]:
        """Fixed noise (seeded) and etas spread over the training range: comparable across calls."""
        generator = make_generator(self.config.seed + 1, device=self.model.device)
        self.denoiser.eval()
        sq, cos, base_sq, base_cos = [], [], [], []
        for indices in length_sorted_batches(self.val_texts, 128):
            texts = [self.val_texts[i] for i in indices]
            eta = sample_etas(self.config, len(texts), generator)
            e_n, noisy, noise, mask, eta, target = self._batch(texts, self.val_targets[indices], eta, generator)
            with torch.inference_mode():
                denoised = self.denoiser(e_n, noisy, noise, mask, eta)
            s, c = loss_terms(denoised, target)
            bs, bc = loss_terms(e_n, target)
            sq.append(s)
            cos.append(c)
            base_sq.append(bs)
            base_cos.append(bc)
        self.denoiser.train()
        d = self.model.hidden_size
        sq_t, cos_t = torch.cat(sq), torch.cat(cos)
        loss = (sq_t + self.config.cosine_weight * (1 - cos_t)).mean().item()
        return {"loss": loss, "mse": sq_t.mean().item() / d, "cosine": cos_t.mean().item(),
                "noisy_mse": torch.cat(base_sq).mean().item() / d, "noisy_cosine": torch.cat(base_cos).mean().item()}

    def _shuffle(self) -> torch.Tensor:
        return torch.randperm(len(self.train_texts), generator=self.generator, device=self.generator.device).cpu()

    def _next_indices(self) -> torch.Tensor:
        size = self.config.batch_size
        if self.state.position + size > len(self.permutation):
            self.state.epoch += 1
            self.state.position = 0
            self.permutation = self._shuffle()
        indices = self.permutation[self.state.position:self.state.position + size]
        self.state.position += size
        return indices

    def train(self, *, resume: bool = False) -> DenoiserCard:
        self.out_dir.mkdir(parents=True, exist_ok=True)
        with self.console.status("Encoding clean targets e_c = G(X) once..."):
            self.train_targets = self._targets(self.train_texts)
            self.val_targets = self._targets(self.val_texts)
        if resume and (self.out_dir / "checkpoint.json").exists():
            self._load_checkpoint()
            self.console.print(f"Resumed at step {self.state.step} (epoch {self.state.epoch})")
        budget = self.config.max_minutes * 60
        started = time.perf_counter() - self.state.seconds
        columns = (TextColumn("[bold]{task.description}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(),
                   TextColumn("{task.fields[metrics]}"))
        self.denoiser.train()
        with Progress(*columns, console=self.console) as progress:
            task = progress.add_task("denoiser", total=self.config.max_steps, completed=self.state.step, metrics="")
            while self.state.step < self.config.max_steps and time.perf_counter() - started < budget:
                self._train_step()
                progress.advance(task)
                if self.state.step % self.config.eval_every == 0:
                    self.state.seconds = time.perf_counter() - started
                    metrics = self._evaluate_and_checkpoint()
                    progress.update(task, metrics=f"val mse {metrics['mse']:.5f} cos {metrics['cosine']:.4f} "
                                                  f"(noisy cos {metrics['noisy_cosine']:.4f})")
                    if self.state.evals_since_best >= self.config.patience:
                        self.console.print(f"Early stop: no validation gain in {self.config.patience} evaluations")
                        break
        self.state.seconds = time.perf_counter() - started
        if not self.state.history or self.state.history[-1]["step"] != self.state.step:
            self._evaluate_and_checkpoint()
        return self._finish()

    def learning_rate(self, step: int) -> float:
        """Linear warm-up over the first 5% of steps, then cosine decay to 10% at ``max_steps``."""
        warmup = max(1, self.config.max_steps // 20)
        if step < warmup:
            return self.config.learning_rate * (step + 1) / warmup
        progress = min(1.0, (step - warmup) / max(1, self.config.max_steps - warmup))
        return self.config.learning_rate * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * progress)))

    def _train_step(self) -> None:
        for group in self.optimiser.param_groups:
            group["lr"] = self.learning_rate(self.state.step)
        indices = self._next_indices()
        texts = [self.train_texts[i] for i in indices]
        eta = sample_etas(self.config, len(texts), self.generator)
        e_n, noisy, noise, mask, eta, target = self._batch(texts, self.train_targets[indices], eta, self.generator)
        sq, cos = loss_terms(self.denoiser(e_n, noisy, noise, mask, eta), target)
        loss = (sq + self.config.cosine_weight * (1 - cos)).mean()
        self.optimiser.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(self.denoiser.parameters(), 1.0)
        self.optimiser.step()
        self.state.step += 1

    def _evaluate_and_checkpoint(self) -> dict[str, float]:
        metrics = self.validate()
        self.state.history.append({"step": self.state.step, "seconds": round(self.state.seconds, 1), **metrics})
        if metrics["loss"] < self.state.best_loss - 1e-6:
            self.state.best_loss, self.state.best_step = metrics["loss"], self.state.step
            self.state.evals_since_best = 0
            save_file({k: v.detach().cpu().contiguous() for k, v in self.denoiser.state_dict().items()},
                      str(self.out_dir / "best.safetensors"))
        else:
            self.state.evals_since_best += 1
        self._save_checkpoint()
        return metrics

    # --- checkpoints (safetensors + JSON) ---------------------------------------------------------
    def _save_checkpoint(self) -> None:
        tensors = {f"model.{k}": v.detach().cpu().contiguous() for k, v in self.denoiser.state_dict().items()}
        optimiser = self.optimiser.state_dict()
        for index, slots in optimiser["state"].items():
            for name, value in slots.items():
                tensors[f"optim.{index}.{name}"] = value.detach().cpu().reshape(-1) if value.ndim == 0 else \
                    value.detach().cpu().contiguous()
        tensors["rng.generator"] = self.generator.get_state()
        tensors["data.permutation"] = self.permutation
        save_file(tensors, str(self.out_dir / "checkpoint.safetensors"))
        meta = {"state": asdict(self.state), "param_groups": optimiser["param_groups"],
                "config": asdict(self.config)}
        (self.out_dir / "checkpoint.json").write_text(json.dumps(meta, indent=1))

    def _load_checkpoint(self) -> None:
        meta = json.loads((self.out_dir / "checkpoint.json").read_text())
        budget = ("max_steps", "max_minutes")  # a resumed run may get more budget, nothing else may change
        saved = {k: v for k, v in meta["config"].items() if k not in budget}
        if saved != {k: v for k, v in json.loads(json.dumps(asdict(self.config))).items() if k not in budget}:
            raise ValueError(f"checkpoint in {self.out_dir} was made with different settings; "
                             "use a new --out folder or the same options")
        tensors = load_file(str(self.out_dir / "checkpoint.safetensors"))
        self.denoiser.load_state_dict({k[6:]: v for k, v in tensors.items() if k.startswith("model.")})
        state: dict[int, dict[str, torch.Tensor]] = {}
        for key, value in tensors.items():
            if key.startswith("optim."):
                _, index, name = key.split(".", 2)
                state.setdefault(int(index), {})[name] = value.reshape(()) if name == "step" else value
        self.optimiser.load_state_dict({"state": state, "param_groups": meta["param_groups"]})
        self.generator.set_state(tensors["rng.generator"])
        self.permutation = tensors["data.permutation"]
        self.state = TrainingState(**meta["state"])

    def _finish(self) -> DenoiserCard:
        self.denoiser.load_state_dict(load_file(str(self.out_dir / "best.safetensors")))
        best = min(self.state.history, key=lambda h: h["loss"])
        card = DenoiserCard(
            config=self.denoiser.config,
            base_model=base_model_facts(self.model),
            training=TrainingRecord(etas=list(self.config.etas) or "log-uniform over eta_range", clip=self.config.clip,
                                    steps=self.state.step, best_step=self.state.best_step, epochs=self.state.epoch,
                                    wall_seconds=round(self.state.seconds, 1),
                                    settings=json.loads(json.dumps(asdict(self.config)))),  # as the JSON holds them
            training_data=TrainingData(sources=self.sources, n_train=len(self.train_texts),
                                       n_validation=len(self.val_texts),
                                       excluded_longer_than_max_tokens=self.excluded_long),
            validation=ValidationFigures(**{k: best[k] for k in ("mse", "cosine", "noisy_mse", "noisy_cosine")}),
            provenance=provenance(seed=self.config.seed),
            history=self.state.history,
        )
        save_denoiser(self.denoiser.eval(), self.out_dir, card)
        return card
