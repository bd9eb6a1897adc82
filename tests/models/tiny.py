"""Tiny random models of each supported family, built from configs (no downloads)."""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

import torch
from transformers import (
    BertConfig,
    BertModel,
    BertTokenizerFast,
    DistilBertConfig,
    DistilBertModel,
    GPT2Config,
    GPT2LMHeadModel,
    LlamaConfig,
    LlamaForCausalLM,
    PreTrainedModel,
    RobertaConfig,
    RobertaModel,
    T5Config,
    T5EncoderModel,
)

if TYPE_CHECKING:
    from privlm.models import SplitModel
    from privlm.models.language import LanguageModel

VOCAB = 99
WORDS = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]", "the", "cat", "sat", "on", "mat", "a", "dog", ".", ","]


def tiny_model(family: str) -> PreTrainedModel:
    torch.manual_seed(0)  # test-only determinism of the random weights
    common = dict(vocab_size=VOCAB)
    if family == "bert":
        model = BertModel(BertConfig(**common, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
                                     intermediate_size=37, max_position_embeddings=64))
    elif family == "roberta":
        model = RobertaModel(RobertaConfig(**common, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
                                           intermediate_size=37, max_position_embeddings=70, pad_token_id=1))
    elif family == "distilbert":
        model = DistilBertModel(DistilBertConfig(**common, dim=32, n_layers=2, n_heads=4, hidden_dim=37,
                                                 max_position_embeddings=64))
    elif family == "gpt2":
        model = GPT2LMHeadModel(GPT2Config(**common, bos_token_id=0, eos_token_id=0, n_embd=32, n_layer=2, n_head=4,
                                           n_positions=64))
    elif family == "llama":
        model = LlamaForCausalLM(LlamaConfig(**common, hidden_size=32, intermediate_size=37, num_hidden_layers=2,
                                             num_attention_heads=4, num_key_value_heads=2,
                                             max_position_embeddings=64))
    elif family == "t5":
        model = T5EncoderModel(T5Config(**common, d_model=32, d_kv=8, d_ff=37, num_layers=2, num_heads=4))
    else:
        raise ValueError(family)
    return model.eval()


def tiny_bert_folder(path: Path) -> Path:
    """A saved tiny BERT with a real WordPiece tokenizer, loadable by ``from_pretrained``."""
    words = WORDS + [f"w{i}" for i in range(VOCAB - len(WORDS))]
    tokenizer = BertTokenizerFast(vocab={word: i for i, word in enumerate(words)})
    model = tiny_model("bert")
    model.save_pretrained(path)
    tokenizer.save_pretrained(path)
    return path


def tiny_masked_lm_folder(path: Path) -> Path:
    """A saved tiny random BertForMaskedLM (64 positions) with the WordPiece tokenizer of ``tiny_bert_folder``."""
    from transformers import BertForMaskedLM

    words = WORDS + [f"w{i}" for i in range(VOCAB - len(WORDS))]
    tokenizer = BertTokenizerFast(vocab={word: i for i, word in enumerate(words)})
    torch.manual_seed(0)  # test-only determinism of the random weights
    model = BertForMaskedLM(BertConfig(vocab_size=VOCAB, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
                                       intermediate_size=37, max_position_embeddings=64)).eval()
    model.save_pretrained(path)
    tokenizer.save_pretrained(path)
    return path


def tiny_causal_lm(*, context: int = 64) -> LanguageModel:
    """A tiny random Llama (SmolLM2's architecture, ``context`` positions) with the WordPiece tokenizer of
    ``tiny_bert_folder``, whose [CLS] starts a context (a causal device model needs a bos token)."""
    from privlm.models.language import LanguageModel

    words = WORDS + [f"w{i}" for i in range(VOCAB - len(WORDS))]
    tokenizer = BertTokenizerFast(vocab={word: i for i, word in enumerate(words)}, bos_token="[CLS]",
                                  eos_token="[SEP]", model_max_length=context,
                                  chat_template="{% for m in messages %}{{ m['content'] }} {% endfor %}")
    torch.manual_seed(0)  # test-only determinism of the random weights
    model = LlamaForCausalLM(LlamaConfig(vocab_size=VOCAB, hidden_size=32, intermediate_size=37, num_hidden_layers=2,
                                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=context,
                                         tie_word_embeddings=True)).eval()
    return LanguageModel(model=model, tokenizer=tokenizer, kind="causal", name="tiny-llama")


def train_tiny_denoiser(model: SplitModel, out_dir: Path, *, variant: str = "snd", steps: int = 2) -> Path:
    """A one-layer denoiser for a tiny model, trained for a couple of steps (services and sweeps tests)."""
    from rich.console import Console

    from privlm.snd.training import DenoiserTrainer, TrainingConfig

    config = TrainingConfig(eta_min=2.0, eta_max=20.0, max_tokens=16, batch_size=8, max_steps=steps, eval_every=steps,
                            n_validation=20, variant=variant,
                            model_overrides={"n_heads": 4, "d_ff": 64, "n_layers": 1})
    corpus = [f"the cat sat on the mat w{i}" for i in range(60)]
    DenoiserTrainer(model, corpus, config=config, out_dir=out_dir, console=Console(quiet=True)).train()
    return out_dir


def tiny_bert_with_minilm_tokenizer(folder: Path, *, blocks: int) -> Path:
    """A saved random BERT of ``blocks`` blocks (width 32, 64 positions) with MiniLM's real tokenizer, loadable by
    name like a packaged model: real text tokenizes as it would for MiniLM, and the model runs in milliseconds."""
    from transformers import AutoTokenizer

    from privlm.models.sources import minilm_source

    tokenizer = AutoTokenizer.from_pretrained(minilm_source().path, local_files_only=True)
    config = BertConfig(vocab_size=tokenizer.vocab_size, hidden_size=32, num_hidden_layers=blocks,
                        num_attention_heads=2, intermediate_size=64, max_position_embeddings=64)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        BertModel(config).save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    return folder
