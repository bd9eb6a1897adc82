"""ChatModel: the decoding loop (generator-only randomness, stop strings, multi-byte text) and its checks."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from privlm.mechanisms import make_generator
from privlm.models.chat import (
    REPLACEMENT,
    ChatModel,
    ChatRequestError,
    ContextLengthError,
    Generation,
    next_token,
    stop_holdback,
)
from privlm.models.language import LanguageModel

pytestmark = pytest.mark.slow
HELLO = [{"role": "user", "content": "Name three colours."}]


class ScriptedLM(torch.nn.Module):
    """A causal LM that answers ``script`` (token ids), one per step, whatever the prompt."""

    def __init__(self, script: list[int], vocab_size: int, eos: int) -> None:
        super().__init__()
        self.anchor = torch.nn.Parameter(torch.zeros(1))  # for LanguageModel.device
        self.config = SimpleNamespace(max_position_embeddings=512)
        self.generation_config = SimpleNamespace(eos_token_id=eos)
        self.script, self.vocab_size = script, vocab_size

    def forward(self, input_ids: torch.Tensor, past_key_values: int | None = None,
                use_cache: bool = True) -> SimpleNamespace:
        step = 0 if past_key_values is None else past_key_values + 1
        logits = torch.zeros(1, input_ids.shape[1], self.vocab_size)
        logits[0, -1, self.script[min(step, len(self.script) - 1)]] = 100.0
        return SimpleNamespace(logits=logits, past_key_values=step)


def scripted(chat_model: ChatModel, text: str) -> ChatModel:
    """A ChatModel on SmolLM2's tokenizer whose answer is ``text``'s tokens, then its end-of-sequence token."""
    tokenizer = chat_model.language_model.tokenizer
    eos = tokenizer.eos_token_id
    ids = [*tokenizer(text, add_special_tokens=False)["input_ids"], eos]
    module = ScriptedLM(ids, len(tokenizer), eos)
    language_model = LanguageModel(model=module, tokenizer=tokenizer, kind="causal", name="scripted")  # type: ignore[arg-type]
    return ChatModel(language_model)


def pieces_and_generation(model: ChatModel, **options: object) -> tuple[list[str], Generation]:
    items = list(model.stream(HELLO, temperature=0, **options))  # type: ignore[arg-type]
    *pieces, generation = items
    assert isinstance(generation, Generation) and all(isinstance(p, str) and p for p in pieces)
    return pieces, generation  # type: ignore[return-value]


def test_greedy_is_deterministic_and_streaming_matches(chat_model: ChatModel) -> None:
    first = chat_model.generate(HELLO, max_tokens=20, temperature=0)
    assert first == chat_model.generate(HELLO, max_tokens=20, temperature=0)
    pieces, generation = pieces_and_generation(chat_model, max_tokens=20)
    assert "".join(pieces) == generation.text == first.text and first.text
    assert generation.prompt_tokens == len(chat_model.prompt_ids(HELLO))


def test_max_tokens_ends_with_length(chat_model: ChatModel) -> None:
    generation = chat_model.generate(HELLO, max_tokens=3, temperature=0)
    assert (generation.finish_reason, generation.completion_tokens) == ("length", 3)


def test_sampling_draws_from_the_generator_only(chat_model: ChatModel) -> None:
    global_state = torch.get_rng_state()
    generator = make_generator(7)
    generator_state = generator.get_state()
    first = chat_model.generate(HELLO, max_tokens=30, temperature=1.0, generator=generator)
    assert torch.equal(torch.get_rng_state(), global_state)  # the global RNG was never drawn from
    assert not torch.equal(generator.get_state(), generator_state)  # the passed one was
    assert chat_model.generate(HELLO, max_tokens=30, temperature=1.0, generator=make_generator(7)) == first
    torch.manual_seed(0)  # the global seed changes nothing
    assert chat_model.generate(HELLO, max_tokens=30, temperature=1.0, generator=make_generator(7)) == first
    assert chat_model.generate(HELLO, max_tokens=30, temperature=1.0, generator=make_generator(8)).text != first.text


def test_top_p_keeps_the_nucleus_only() -> None:
    logits = torch.tensor([0.5, 0.3, 0.2]).log()
    generator = make_generator(3)
    draws = {next_token(logits, temperature=1.0, top_p=0.75, generator=generator) for _ in range(300)}
    assert draws == {0, 1}  # 0.5 + 0.3 reach 0.75; 0.2 is cut
    draws = {next_token(logits, temperature=1.0, top_p=1.0, generator=generator) for _ in range(300)}
    assert draws == {0, 1, 2}
    assert {next_token(logits, temperature=1.0, top_p=0.4, generator=generator) for _ in range(50)} == {0}
    assert next_token(logits, temperature=0, top_p=1.0, generator=generator) == 0


def test_stop_string_across_token_boundaries_is_held_back(chat_model: ChatModel) -> None:
    model = scripted(chat_model, "Hello STOP world")  # tokens: "Hello", " ST", "OP", " world"
    pieces, generation = pieces_and_generation(model, stop=["STOP"])
    assert pieces == ["Hello", " "]  # "ST" was held back, then dropped with the stop string
    assert (generation.text, generation.finish_reason, generation.completion_tokens) == ("Hello ", "stop", 3)
    # A prefix that turns out not to begin the stop string is released once that is known.
    pieces, generation = pieces_and_generation(model, stop=["ST!"])
    assert pieces == ["Hello", " ", "STOP", " world"]
    assert (generation.text, generation.finish_reason) == ("Hello STOP world", "stop")  # at the eos


def test_stop_string_inside_one_token_and_after_length(chat_model: ChatModel) -> None:
    model = scripted(chat_model, "Hello STOP world")
    pieces, generation = pieces_and_generation(model, stop=["O", "wor"])
    assert "".join(pieces) == generation.text == "Hello ST"
    pieces, generation = pieces_and_generation(model, stop=["ST!"], max_tokens=2)
    assert pieces == ["Hello", " ", "ST"]  # held back, then flushed at the end: "ST" never became "ST!"
    assert generation.finish_reason == "length"


def test_multi_byte_characters_cut_between_tokens(chat_model: ChatModel) -> None:
    text = "Café 日本語 🙂 done"
    tokenizer = chat_model.language_model.tokenizer
    ids = tokenizer(text, add_special_tokens=False)["input_ids"]
    assert any(tokenizer.decode(ids[:i]).endswith(REPLACEMENT) for i in range(1, len(ids)))  # the test bites
    pieces, generation = pieces_and_generation(scripted(chat_model, text))
    assert not any(REPLACEMENT in piece for piece in pieces)
    assert "".join(pieces) == generation.text == text
    assert generation.completion_tokens == len(ids) + 1  # the eos counts


def test_stop_holdback() -> None:
    assert stop_holdback("Hello ST", ["STOP"]) == 2
    assert stop_holdback("Hello S", ["xx", "STOP", "S"]) == 1
    assert stop_holdback("Hello", ["STOP"]) == 0
    assert stop_holdback("ab", ["abab"]) == 2


def test_prompt_longer_than_the_context_is_refused(chat_model: ChatModel) -> None:
    long = [{"role": "user", "content": "word " * 9000}]
    with pytest.raises(ContextLengthError) as caught:
        chat_model.stream(long, max_tokens=10)
    count = len(chat_model.prompt_ids(long))
    assert caught.value.prompt_tokens == count and caught.value.limit == chat_model.context_length - 10
    assert str(count) in str(caught.value) and str(chat_model.context_length - 10) in str(caught.value)
    assert caught.value.param == "messages"


@pytest.mark.parametrize(("options", "param"), [
    ({"max_tokens": 0}, "max_tokens"), ({"max_tokens": 8192}, "max_tokens"), ({"max_tokens": True}, "max_tokens"),
    ({"temperature": -0.1}, "temperature"), ({"temperature": float("nan")}, "temperature"),
    ({"top_p": 0}, "top_p"), ({"top_p": 1.5}, "top_p"), ({"stop": [""]}, "stop"), ({"stop": [3]}, "stop"),
])
def test_bad_parameters_are_named(chat_model: ChatModel, options: dict[str, object], param: str) -> None:
    with pytest.raises(ChatRequestError, match=param) as caught:
        chat_model.stream(HELLO, **options)  # type: ignore[arg-type]
    assert caught.value.param == param


@pytest.mark.parametrize(("messages", "param"), [
    ([], "messages"), ("hello", "messages"), ([{"role": "tool", "content": "x"}], "messages[0].role"),
    ([{"role": "user", "content": "x"}, {"role": "user", "content": None}], "messages[1].content"),
])
def test_bad_messages_are_named(chat_model: ChatModel, messages: object, param: str) -> None:
    with pytest.raises(ChatRequestError) as caught:
        chat_model.prompt_ids(messages)  # type: ignore[arg-type]
    assert caught.value.param == param and param in str(caught.value)


def test_generator_on_another_device_or_of_another_type_is_refused(chat_model: ChatModel) -> None:
    with pytest.raises(ValueError, match="generator"):
        chat_model.stream(HELLO, generator="seed")  # type: ignore[arg-type]


def test_a_masked_lm_is_refused(tiny_masked_lm: LanguageModel) -> None:
    with pytest.raises(ValueError, match="causal"):
        ChatModel(tiny_masked_lm)


def test_a_tokenizer_without_chat_template_is_refused(chat_model: ChatModel) -> None:
    import copy

    tokenizer = copy.deepcopy(chat_model.language_model.tokenizer)
    tokenizer.chat_template = None
    language_model = LanguageModel(model=chat_model.language_model.model, tokenizer=tokenizer, kind="causal")
    with pytest.raises(ValueError, match="chat template"):
        ChatModel(language_model)


def test_names(chat_model: ChatModel) -> None:
    assert chat_model.name == "smollm2-135m-instruct" and chat_model.context_length == 8192 and chat_model.eos_ids
    assert ChatModel(chat_model.language_model, name="mine").name == "mine"
