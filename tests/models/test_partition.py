"""The split at any depth: bottom then top is the whole model, the export holds only the bottom, bad input is refused.

Tiny random BERT/RoBERTa models are built here under ``torch.random.fork_rng`` (the global RNG is left as it was).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file, save_file
from transformers import (
    BertConfig,
    BertModel,
    ElectraConfig,
    ElectraModel,
    GPT2Config,
    GPT2Model,
    PreTrainedModel,
    RobertaConfig,
    RobertaModel,
)

from privlm.models import BottomModel, TopModel, load_bottom, make_head, split_model, weights_sha256
from privlm.models.partition import BOTTOM_CONFIG, BOTTOM_WEIGHTS
from privlm.models.pooling import POOLERS

ATOL = 1e-5
DEPTHS = (0, 1, 2)
SIZES: dict[str, Any] = dict(vocab_size=100, hidden_size=32, num_hidden_layers=3, num_attention_heads=2,
                             intermediate_size=64)


def _build(kind: str, seed: int = 0) -> PreTrainedModel:
    """A tiny random model whose every weight is distinct (no two LayerNorms left at exactly 1 and 0)."""
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        if kind == "bert":
            model: PreTrainedModel = BertModel(BertConfig(**SIZES))
        elif kind == "roberta":
            model = RobertaModel(RobertaConfig(**SIZES, max_position_embeddings=40, pad_token_id=1))
        else:
            raise ValueError(kind)
        with torch.no_grad():  # so "no tensor of the top equals one of the bottom" tests the export, not the init
            for parameter in model.parameters():
                parameter.add_(0.01 * torch.randn_like(parameter))
    return model.eval()


def _batch(model: PreTrainedModel, *, left: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """Three sequences of lengths 7, 4 and 2, padded with the model's pad id (right, or left)."""
    pad = model.config.pad_token_id
    rows = [[2, 5, 6, 7, 8, 9, 3], [2, 10, 11, 3], [2, 3]]
    width = max(map(len, rows))
    ids, mask = [], []
    for row in rows:
        fill = width - len(row)
        ids.append([pad] * fill + row if left else row + [pad] * fill)
        mask.append([0] * fill + [1] * len(row) if left else [1] * len(row) + [0] * fill)
    return torch.tensor(ids), torch.tensor(mask)


def _whole(model: PreTrainedModel, ids: torch.Tensor, mask: torch.Tensor, pooling: str) -> torch.Tensor:
    with torch.no_grad():
        return POOLERS[pooling](model(input_ids=ids, attention_mask=mask).last_hidden_state, mask)


def _split_output(model: PreTrainedModel, k: int, ids: torch.Tensor, mask: torch.Tensor, pooling: str) -> torch.Tensor:
    bottom, top = split_model(model, k, pooling=pooling)  # type: ignore[arg-type]
    with torch.no_grad():
        return top(bottom(ids, mask), mask)


@pytest.fixture(scope="module")
def tiny() -> dict[str, PreTrainedModel]:
    return {"bert": _build("bert"), "roberta": _build("roberta")}


@pytest.fixture(scope="module")
def minilm_model() -> tuple[PreTrainedModel, torch.Tensor, torch.Tensor]:
    from privlm.models.loading import load_pretrained

    loaded = load_pretrained("minilm", device=torch.device("cpu"))
    batch = loaded.tokenizer(["the cat sat on the mat and looked at the dog", "hello", "a short one ."],
                             padding=True, return_tensors="pt")
    return loaded.model, batch["input_ids"], batch["attention_mask"]


# --- bottom then top is the whole model ---------------------------------------------------------------------------


@pytest.mark.parametrize("kind", ["bert", "roberta"])
@pytest.mark.parametrize("pooling", ["mean", "cls"])
@pytest.mark.parametrize("k", DEPTHS)
def test_bottom_then_top_is_the_whole_model(tiny: dict[str, PreTrainedModel], kind: str, pooling: str,
                                            k: int) -> None:
    model = tiny[kind]
    ids, mask = _batch(model)
    assert mask.sum(1).unique().numel() == 3  # padding in the batch, of different lengths
    expected = _whole(model, ids, mask, pooling)
    torch.testing.assert_close(_split_output(model, k, ids, mask, pooling), expected, atol=ATOL, rtol=0)


@pytest.mark.parametrize("kind", ["bert", "roberta"])
@pytest.mark.parametrize("k", [0, 1])
def test_left_padding_keeps_the_whole_models_positions(tiny: dict[str, PreTrainedModel], kind: str, k: int) -> None:
    # RoBERTa numbers positions from the first real token; the split must do the same from the mask.
    model = tiny[kind]
    ids, mask = _batch(model, left=True)
    expected = _whole(model, ids, mask, "mean")
    torch.testing.assert_close(_split_output(model, k, ids, mask, "mean"), expected, atol=ATOL, rtol=0)


@pytest.mark.slow
@pytest.mark.parametrize("k", DEPTHS)
def test_minilm_bottom_then_top_is_the_whole_model(
        minilm_model: tuple[PreTrainedModel, torch.Tensor, torch.Tensor], k: int) -> None:
    model, ids, mask = minilm_model
    assert (mask == 0).any()
    expected = _whole(model, ids, mask, "mean")
    torch.testing.assert_close(_split_output(model, k, ids, mask, "mean"), expected, atol=ATOL, rtol=0)


def test_the_bottom_from_word_rows_is_the_bottom(tiny: dict[str, PreTrainedModel]) -> None:
    model: Any = tiny["bert"]
    ids, mask = _batch(model)
    bottom, _ = split_model(model, 1)
    assert torch.equal(bottom.vocabulary, model.embeddings.word_embeddings.weight)
    with torch.no_grad():
        assert torch.equal(bottom.forward_from_words(bottom.embed_words(ids), mask), bottom(ids, mask))
    bottom0, _ = split_model(model, 0)
    with torch.no_grad():
        assert torch.equal(bottom0(ids, mask), model.embeddings.word_embeddings(ids))
    assert (bottom0.depth, bottom.depth) == (0, 1)


@pytest.mark.parametrize("k", [0, 2])
def test_with_classes_the_top_returns_the_heads_logits(tiny: dict[str, PreTrainedModel], k: int) -> None:
    model = tiny["bert"]
    ids, mask = _batch(model)
    bottom, top = split_model(model, k, pooling="mean", n_classes=4)
    assert top.head is not None
    with torch.no_grad():
        logits = top(bottom(ids, mask), mask)
        assert logits.shape == (3, 4)
        torch.testing.assert_close(logits, top.head(_whole(model, ids, mask, "mean")), atol=ATOL, rtol=0)
        assert torch.equal(logits, top.head(top.represent(bottom(ids, mask), mask)))
    assert split_model(model, k)[1].head is None


def test_the_head_is_seeded_and_follows_the_models_dtype(tiny: dict[str, PreTrainedModel]) -> None:
    assert torch.equal(make_head(32, 3, seed=5).weight, make_head(32, 3, seed=5).weight)
    assert not torch.equal(make_head(32, 3, seed=5).weight, make_head(32, 3, seed=6).weight)
    state = torch.random.get_rng_state()
    make_head(32, 3, seed=5)
    assert torch.equal(torch.random.get_rng_state(), state)  # the global RNG is neither used nor moved
    half: Any = torch.nn.Module.to(_build("bert"), torch.bfloat16)
    ids, mask = _batch(half)
    bottom, top = split_model(half, 1, n_classes=2)
    with torch.no_grad():
        logits = top(bottom(ids, mask), mask)
    assert logits.dtype == torch.bfloat16 and logits.shape == (3, 2)


# --- the export holds the bottom and nothing of the top -----------------------------------------------------------


def _in_model(name: str, offset: int) -> str:
    """A part's tensor name as the whole model calls it: each part numbers its own blocks from 0."""
    if name.startswith("blocks.layer."):
        index, rest = name.removeprefix("blocks.layer.").split(".", 1)
        return f"encoder.layer.{int(index) + offset}.{rest}"
    return "embeddings.word_embeddings.weight" if name == "word_embeddings.weight" else name


def _exported(directory: Path) -> dict[str, torch.Tensor]:
    with safe_open(str(directory / BOTTOM_WEIGHTS), framework="pt") as handle:
        return {name: handle.get_tensor(name) for name in handle.keys()}  # noqa: SIM118 (safe_open has no iterator)


@pytest.mark.parametrize("kind", ["bert", "roberta"])
@pytest.mark.parametrize("k", DEPTHS)
def test_the_customers_file_holds_none_of_the_tops_weights(tiny: dict[str, PreTrainedModel], kind: str, k: int,
                                                           tmp_path: Path) -> None:
    bottom, top = split_model(tiny[kind], k, n_classes=3)
    exported = _exported(bottom.save(tmp_path))
    top_state = top.state_dict()
    assert top_state  # blocks k.., the head, and for k = 0 the position/type embeddings and LayerNorm
    assert "head.weight" in top_state and any(name.startswith("blocks.layer.") for name in top_state)
    if k == 0:
        assert {"embeddings.position_embeddings.weight", "embeddings.LayerNorm.weight"} <= set(top_state)
        assert not any("word_embeddings" in name for name in top_state)
    bottom_names = {_in_model(name, 0) for name in exported}
    top_names = {_in_model(name, k) for name in top_state}
    assert bottom_names <= set(tiny[kind].state_dict())  # the mapping to the model's names is sound
    assert not bottom_names & top_names
    for name, tensor in exported.items():
        clashes = [other for other, theirs in top_state.items()
                   if theirs.shape == tensor.shape and torch.equal(theirs, tensor)]
        assert not clashes, f"the export's {name} equals the top's {clashes}"


@pytest.mark.parametrize("k", DEPTHS)
def test_the_customers_file_holds_exactly_the_bottom(tiny: dict[str, PreTrainedModel], k: int,
                                                     tmp_path: Path) -> None:
    bottom, _ = split_model(tiny["bert"], k)
    exported = _exported(bottom.save(tmp_path))
    state = bottom.state_dict()
    if k == 0:
        assert set(exported) == {"word_embeddings.weight"}
    else:  # the word table is stored once, under the embeddings
        assert set(exported) == set(state) - {"word_embeddings.weight"}
        assert not any(name.startswith(f"blocks.layer.{k}.") for name in exported)
    for name, tensor in exported.items():
        assert torch.equal(tensor, state[name]), name


@pytest.mark.parametrize("kind", ["bert", "roberta"])
@pytest.mark.parametrize("k", DEPTHS)
def test_the_loaded_bottom_reproduces_the_bottom(tiny: dict[str, PreTrainedModel], kind: str, k: int,
                                                 tmp_path: Path) -> None:
    model = tiny[kind]
    bottom, top = split_model(model, k)
    bottom.save(tmp_path)
    config = json.loads((tmp_path / BOTTOM_CONFIG).read_text())
    assert config.keys() == {"format", "model_name", "model_type", "blocks", "total_blocks", "hidden_size",
                             "vocab_size", "model_config", "fingerprint"}  # the file format of privlm-sap-bottom/1
    assert config["fingerprint"] == top.bottom_fingerprint == weights_sha256(bottom)
    assert (config["blocks"], config["total_blocks"], config["hidden_size"]) == (k, 3, 32)
    assert config["model_config"]["model_type"] == kind
    rng = torch.random.get_rng_state()
    loaded = load_bottom(tmp_path, expected_fingerprint=top.bottom_fingerprint)
    assert torch.equal(torch.random.get_rng_state(), rng)  # rebuilding drew nothing from the global RNG
    assert isinstance(loaded, BottomModel) and loaded.depth == k and not loaded.training
    ids, mask = _batch(model, left=True)
    with torch.no_grad():
        assert torch.equal(loaded(ids, mask), bottom(ids, mask))
    assert loaded.config.model_dump() == json.loads(json.dumps(bottom.config.model_dump()))  # as JSON keeps it


# --- mismatched or tampered files ----------------------------------------------------------------------------------


def test_a_bottom_for_another_top_is_refused(tiny: dict[str, PreTrainedModel], tmp_path: Path) -> None:
    bottom, _ = split_model(tiny["bert"], 1)
    bottom.save(tmp_path)
    _, other_model_top = split_model(_build("bert", seed=1), 1)
    _, other_depth_top = split_model(tiny["bert"], 2)
    for top in (other_model_top, other_depth_top):
        with pytest.raises(ValueError, match="not the one"):
            load_bottom(tmp_path, expected_fingerprint=top.bottom_fingerprint)


@pytest.mark.parametrize("k", [0, 1])
def test_a_tampered_weight_file_is_refused(tiny: dict[str, PreTrainedModel], k: int, tmp_path: Path) -> None:
    bottom, top = split_model(tiny["bert"], k)
    bottom.save(tmp_path)
    state = load_file(str(tmp_path / BOTTOM_WEIGHTS))
    name = sorted(state)[-1]
    state[name] = state[name].clone()
    state[name].view(-1)[0] += 1e-3
    save_file(state, str(tmp_path / BOTTOM_WEIGHTS))
    with pytest.raises(ValueError, match="hash"):
        load_bottom(tmp_path)  # its own config's fingerprint no longer matches
    with pytest.raises(ValueError, match="hash"):
        load_bottom(tmp_path, expected_fingerprint=top.bottom_fingerprint)


def test_a_weight_file_of_another_shape_or_depth_is_refused(tiny: dict[str, PreTrainedModel],
                                                            tmp_path: Path) -> None:
    bottom, _ = split_model(tiny["bert"], 1)
    bottom.save(tmp_path)
    state = load_file(str(tmp_path / BOTTOM_WEIGHTS))
    save_file({**state, "embeddings.LayerNorm.weight": torch.ones(7)}, str(tmp_path / BOTTOM_WEIGHTS))
    with pytest.raises(ValueError, match="does not match"):
        load_bottom(tmp_path)
    save_file({k: v for k, v in state.items() if not k.startswith("blocks.")}, str(tmp_path / BOTTOM_WEIGHTS))
    with pytest.raises(ValueError, match="does not match"):
        load_bottom(tmp_path)


@pytest.mark.parametrize("edit", [
    lambda c: {**c, "format": "privlm-sap-bottom/0"},
    lambda c: {k: v for k, v in c.items() if k != "format"},
    lambda c: {**c, "surprise": 1},
    lambda c: {k: v for k, v in c.items() if k != "blocks"},
    lambda c: [c],
], ids=["old-format", "no-format", "unknown-field", "missing-field", "not-an-object"])
def test_a_bottom_config_of_the_wrong_format_is_refused(tiny: dict[str, PreTrainedModel], tmp_path: Path,
                                                        edit: object) -> None:
    bottom, _ = split_model(tiny["bert"], 1)
    bottom.save(tmp_path)
    config = json.loads((tmp_path / BOTTOM_CONFIG).read_text())
    (tmp_path / BOTTOM_CONFIG).write_text(json.dumps(edit(config)))  # type: ignore[operator]
    with pytest.raises(ValueError, match="bottom"):
        load_bottom(tmp_path)


@pytest.mark.parametrize(("change", "field"), [
    ({"surprise": 1}, "surprise"), ({"blocks": "1"}, "blocks"), ({"blocks": -1}, "blocks"),
    ({"hidden_size": 0}, "hidden_size"), ({"model_config": "bert"}, "model_config"),
])
def test_a_bottom_config_with_an_unknown_key_or_a_bad_value_names_it(tiny: dict[str, PreTrainedModel],
                                                                     tmp_path: Path, change: dict[str, object],
                                                                     field: str) -> None:
    bottom, _ = split_model(tiny["bert"], 1)
    bottom.save(tmp_path)
    config = json.loads((tmp_path / BOTTOM_CONFIG).read_text())
    (tmp_path / BOTTOM_CONFIG).write_text(json.dumps(config | change))
    with pytest.raises(ValueError, match=rf"is not a valid bottom config: {field}: ") as refused:
        load_bottom(tmp_path)
    assert "\n" not in str(refused.value)


# --- bad input ------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("blocks", [-1, 3, 4, True, 1.5, "1", None])
def test_blocks_out_of_range_are_refused(tiny: dict[str, PreTrainedModel], blocks: object) -> None:
    with pytest.raises(ValueError, match="blocks"):
        split_model(tiny["bert"], blocks)  # type: ignore[arg-type]


def test_an_unknown_pooling_is_refused(tiny: dict[str, PreTrainedModel]) -> None:
    with pytest.raises(ValueError, match="pooling"):
        split_model(tiny["bert"], 1, pooling="max")  # type: ignore[arg-type]


def test_an_unsupported_model_type_is_refused() -> None:
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        gpt2 = GPT2Model(GPT2Config(vocab_size=100, n_embd=32, n_layer=3, n_head=2, n_positions=16))
    with pytest.raises(ValueError, match="'gpt2'"):
        split_model(gpt2, 1)


def test_an_electra_with_a_projected_embedding_is_refused() -> None:
    # ELECTRA-small projects its 128-wide embeddings to the hidden size outside the embedding module.
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        electra = ElectraModel(ElectraConfig(**{**SIZES, "embedding_size": 16}))
    with pytest.raises(ValueError, match="embedding size"):
        split_model(electra, 1)


@pytest.mark.parametrize("k", [0, 1])
def test_a_cut_of_the_wrong_width_or_dtype_is_refused(tiny: dict[str, PreTrainedModel], k: int) -> None:
    _, top = split_model(tiny["bert"], k)
    mask = torch.ones(2, 5, dtype=torch.long)
    with pytest.raises(ValueError, match="dimension 16"):
        top(torch.zeros(2, 5, 16), mask)
    with pytest.raises(ValueError, match=r"cut.*floating"):
        top(torch.zeros(2, 5, 32, dtype=torch.long), mask)
    with pytest.raises(ValueError, match=r"cut.*dimensions"):
        top(torch.zeros(2, 32), mask)
    with pytest.raises(ValueError, match=r"cut.*NaN"):
        top(torch.full((2, 5, 32), float("nan")), mask)


@pytest.mark.parametrize("n_classes", [1, 0, -2, True, 2.5])
def test_a_head_needs_two_classes(n_classes: object) -> None:
    with pytest.raises(ValueError, match="n_classes"):
        make_head(32, n_classes)  # type: ignore[arg-type]


# --- independent parts ---------------------------------------------------------------------------------------------


def _storages(module: torch.nn.Module) -> set[int]:
    tensors = [*module.parameters(), *module.buffers()]
    return {t.untyped_storage().data_ptr() for t in tensors if t.numel()}


@pytest.mark.parametrize("k", DEPTHS)
def test_the_parts_share_no_storage(tiny: dict[str, PreTrainedModel], k: int) -> None:
    model = tiny["bert"]
    bottom, top = split_model(model, k, n_classes=2)
    assert isinstance(top, TopModel)
    parts = {"bottom": _storages(bottom), "top": _storages(top), "model": _storages(model)}
    assert parts["bottom"] and parts["top"]
    assert not parts["bottom"] & parts["top"]
    assert not parts["bottom"] & parts["model"]
    assert not parts["top"] & parts["model"]


def _snapshot(module: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {key: value.clone() for key, value in module.state_dict().items()}


def _same(module: torch.nn.Module, snapshot: dict[str, torch.Tensor]) -> bool:
    return all(torch.equal(value, snapshot[key]) for key, value in module.state_dict().items())


@pytest.mark.parametrize("trained", ["bottom", "top"])
@pytest.mark.parametrize("k", [0, 1])
def test_training_one_part_moves_neither_the_other_nor_the_model(tiny: dict[str, PreTrainedModel], k: int,
                                                                 trained: str) -> None:
    model = tiny["bert"]
    ids, mask = _batch(model)
    bottom, top = split_model(model, k, n_classes=2)
    parts = {"bottom": bottom, "top": top}
    before = {name: _snapshot(part) for name, part in {**parts, "model": model}.items()}
    optimizer = torch.optim.SGD(parts[trained].parameters(), lr=1.0)
    top(bottom(ids, mask), mask).square().sum().backward()  # both parts get gradients; only one steps
    optimizer.step()
    untouched = "top" if trained == "bottom" else "bottom"
    assert not _same(parts[trained], before[trained])
    assert _same(parts[untouched], before[untouched])
    assert _same(model, before["model"])
