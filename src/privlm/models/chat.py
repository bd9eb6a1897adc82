"""Chat generation on a local causal LM, with no HTTP: the engine behind ``privlm serve-llm``.

:class:`ChatModel` renders chat messages with the tokenizer's chat template and decodes with its own loop
(a KV cache, under ``torch.inference_mode()``), so that every random draw comes from the ``torch.Generator``
passed in (OS entropy by default), never from torch's global RNG. Temperature 0 is greedy; ``top_p`` keeps
the smallest set of likeliest tokens whose mass reaches it. Generation ends at an end-of-sequence token
(finish reason ``stop``), at ``max_tokens`` (``length``), or at a stop string (``stop``; the stop string and
what follows it are dropped).

:meth:`ChatModel.stream` yields the text as it is decoded, and never a character it may have to take back:
it holds back a trailing U+FFFD (a multi-byte character cut between tokens) and as many trailing characters
as could begin a stop string. Its last item is the :class:`Generation`, whose text is the pieces joined.
"""

from __future__ import annotations

import math
from collections.abc import Generator, Mapping, Sequence
from dataclasses import dataclass
from typing import Literal

import torch

from privlm.mechanisms.randomness import resolve_generator
from privlm.models.kv_cache import cache_of, with_cache
from privlm.models.language import LanguageModel
from privlm.validation import check_in_interval

ChatRole = Literal["system", "user", "assistant"]
CHAT_ROLES: tuple[ChatRole, ...] = ("system", "user", "assistant")
FinishReason = Literal["stop", "length"]
REPLACEMENT = "\ufffd"  # what a byte-level tokenizer decodes a cut multi-byte character to
_PUBLIC_NAMES = {"smollm2": "smollm2-135m-instruct"}


@dataclass(frozen=True)
class Generation:
    """A finished generation. ``completion_tokens`` counts every token sampled, the end-of-sequence one too."""

    text: str
    finish_reason: FinishReason
    prompt_tokens: int
    completion_tokens: int


class ChatRequestError(ValueError):
    """A chat request :class:`ChatModel` cannot serve; ``param`` names the parameter at fault."""

    def __init__(self, param: str, message: str) -> None:
        super().__init__(message)
        self.param = param


class ContextLengthError(ChatRequestError):
    """The prompt leaves fewer than ``max_tokens`` places in the model's context."""

    def __init__(self, prompt_tokens: int, limit: int, max_tokens: int, context_length: int) -> None:
        super().__init__("messages", f"the prompt holds {prompt_tokens} tokens, more than the {limit} allowed: the "
                                     f"model's context of {context_length} tokens less max_tokens={max_tokens}")
        self.prompt_tokens, self.limit = prompt_tokens, limit


@dataclass(frozen=True)
class SamplingOptions:
    """The checked parameters of one generation."""

    max_tokens: int
    temperature: float
    top_p: float
    stop: tuple[str, ...]


def check_sampling(*, max_tokens: object, temperature: object, top_p: object, stop: object,
                   context_length: int) -> SamplingOptions:
    """The one place chat parameters are checked; a :class:`ChatRequestError` names the one at fault."""
    if isinstance(max_tokens, bool) or not isinstance(max_tokens, int) or not 1 <= max_tokens < context_length:
        raise ChatRequestError("max_tokens", f"max_tokens must be an integer from 1 to {context_length - 1} (the "
                                             f"context less one token of prompt), got {max_tokens!r}")
    try:
        temperature = check_in_interval("temperature", temperature, 0, math.inf, high_open=True)
        top_p = check_in_interval("top_p", top_p, 0, 1, low_open=True)
    except ValueError as error:  # the message starts with the parameter's name
        raise ChatRequestError(str(error).split()[0], str(error)) from None
    stops = (stop,) if isinstance(stop, str) else stop
    if not isinstance(stops, Sequence) or any(not isinstance(s, str) or not s for s in stops):
        raise ChatRequestError("stop", "stop must be a sequence of non-empty strings")
    return SamplingOptions(max_tokens, temperature, top_p, tuple(stops))


def next_token(logits: torch.Tensor, *, temperature: float, top_p: float, generator: torch.Generator) -> int:
    """A token id drawn from ``logits`` (one row) with ``generator``: greedy at temperature 0, else the
    softmax at ``temperature`` cut to its nucleus of mass ``top_p``."""
    if temperature == 0:
        return int(logits.argmax())
    probabilities = torch.softmax(logits.float() / temperature, dim=-1)
    if top_p < 1:
        sorted_p, order = probabilities.sort(descending=True)
        before = sorted_p.cumsum(-1) - sorted_p  # mass of the likelier tokens: keep while it is below top_p
        sorted_p = sorted_p.masked_fill(before >= top_p, 0.0)
        choice = torch.multinomial(sorted_p, 1, generator=generator)
        return int(order[choice])
    return int(torch.multinomial(probabilities, 1, generator=generator))


def stop_holdback(text: str, stops: Sequence[str]) -> int:
    """How many trailing characters of ``text`` could begin one of ``stops`` (so may not be sent yet)."""
    held = 0
    for stop in stops:
        for length in range(min(len(stop) - 1, len(text)), held, -1):
            if text.endswith(stop[:length]):
                held = length
                break
    return held


def find_stop(text: str, stops: Sequence[str]) -> int | None:
    """Where the earliest of ``stops`` begins in ``text``, or None."""
    found = [index for stop in stops if (index := text.find(stop)) >= 0]
    return min(found) if found else None


class ChatModel:
    """A local causal LM that answers chat messages (its tokenizer's chat template)."""

    def __init__(self, language_model: LanguageModel, *, name: str | None = None) -> None:
        if language_model.kind != "causal":
            raise ValueError(f"language_model must be a causal LM to generate text; {language_model.name} is "
                             f"{language_model.kind}")
        if not getattr(language_model.tokenizer, "chat_template", None):
            raise ValueError(f"language_model's tokenizer ({language_model.name}) has no chat template")
        self.language_model = language_model
        self.name = name or _PUBLIC_NAMES.get(language_model.name, language_model.name)
        self.context_length = language_model.context_length
        self.eos_ids = _eos_ids(language_model)

    @classmethod
    def from_pretrained(cls, name_or_path: str = "smollm2", *, device: str = "auto") -> ChatModel:
        """Load ``"smollm2"`` (SmolLM2-135M-Instruct), a local folder or a cached HF id; never downloads."""
        return cls(LanguageModel.from_pretrained(name_or_path, device=device, kind="causal"))

    @property
    def device(self) -> torch.device:
        return self.language_model.device

    def prompt_ids(self, messages: Sequence[Mapping[str, str]]) -> list[int]:
        """The chat template's token ids for ``messages`` (``role``: system, user or assistant; ``content``:
        a string), ending with the assistant's turn to speak."""
        if isinstance(messages, str | bytes) or not isinstance(messages, Sequence) or not messages:
            raise ChatRequestError("messages", "messages must be a non-empty sequence of role/content mappings")
        checked = [_checked_message(index, message) for index, message in enumerate(messages)]
        tokenizer = self.language_model.tokenizer
        text = tokenizer.apply_chat_template(checked, add_generation_prompt=True, tokenize=False)
        if not isinstance(text, str):
            raise ValueError(f"the chat template rendered {type(text).__name__}, not text")
        return list(tokenizer(text, add_special_tokens=False)["input_ids"])

    def stream(self, messages: Sequence[Mapping[str, str]], *, max_tokens: int = 256, temperature: float = 1.0,
               top_p: float = 1.0, stop: Sequence[str] = (), generator: torch.Generator | None = None
               ) -> Generator[str | Generation, None, None]:
        """Text pieces as they are decoded (non-empty strings), then the :class:`Generation` as the last item.

        Parameters, messages and the prompt's length are checked now (a :class:`ChatRequestError`, or its
        subclass :class:`ContextLengthError`), before the first item is asked for. Closing the iterator
        stops the generation.
        """
        options = check_sampling(max_tokens=max_tokens, temperature=temperature, top_p=top_p, stop=stop,
                                 context_length=self.context_length)
        ids = self.checked_prompt_ids(messages, max_tokens=options.max_tokens)
        return self._decode(ids, options, resolve_generator(generator, self.device))

    def checked_prompt_ids(self, messages: Sequence[Mapping[str, str]], *, max_tokens: int) -> list[int]:
        """:meth:`prompt_ids`, refused (:class:`ContextLengthError`) when they leave fewer than ``max_tokens``
        places in the model's context."""
        ids = self.prompt_ids(messages)
        limit = self.context_length - max_tokens
        if len(ids) > limit:
            raise ContextLengthError(len(ids), limit, max_tokens, self.context_length)
        return ids

    def generate(self, messages: Sequence[Mapping[str, str]], *, max_tokens: int = 256, temperature: float = 1.0,
                 top_p: float = 1.0, stop: Sequence[str] = (), generator: torch.Generator | None = None
                 ) -> Generation:
        """The whole answer at once (see :meth:`stream`)."""
        for item in self.stream(messages, max_tokens=max_tokens, temperature=temperature, top_p=top_p, stop=stop,
                                generator=generator):
            if isinstance(item, Generation):
                return item
        raise AssertionError("stream ended without its Generation")  # stream always ends with one

    def _decode(self, prompt: list[int], options: SamplingOptions, generator: torch.Generator
                ) -> Generator[str | Generation, None, None]:
        model, tokenizer = self.language_model.model, self.language_model.tokenizer
        completion: list[int] = []
        text, sent = "", 0  # sent: characters of text already yielded
        finish: FinishReason = "length"
        with torch.inference_mode():
            inputs, past = torch.tensor([prompt], device=self.device), None
            for _ in range(options.max_tokens):
                output = model(input_ids=inputs, use_cache=True, **with_cache(model, past))
                past = cache_of(model, output)
                token = next_token(output.logits[0, -1], temperature=options.temperature, top_p=options.top_p,
                                   generator=generator)
                completion.append(token)
                if token in self.eos_ids:
                    finish = "stop"
                    break
                # The whole completion, decoded again: a character cut between tokens heals once complete.
                text = str(tokenizer.decode(completion, skip_special_tokens=True, clean_up_tokenization_spaces=False))
                cut = find_stop(text, options.stop)
                if cut is not None:
                    text, finish = text[:cut], "stop"
                    break
                ready = len(text.rstrip(REPLACEMENT))
                ready = min(ready, len(text) - stop_holdback(text, options.stop))
                if ready > sent:
                    yield text[sent:ready]
                    sent = ready
                inputs = torch.tensor([[token]], device=self.device)
        if len(text) > sent:
            yield text[sent:]
        yield Generation(text=text, finish_reason=finish, prompt_tokens=len(prompt),
                         completion_tokens=len(completion))


def _checked_message(index: int, message: object) -> dict[str, str]:
    if not isinstance(message, Mapping):
        raise ChatRequestError(f"messages[{index}]", f"messages[{index}] must be a mapping with role and content")
    role, content = message.get("role"), message.get("content")
    if role not in CHAT_ROLES:
        raise ChatRequestError(f"messages[{index}].role",
                               f"messages[{index}].role must be one of {CHAT_ROLES}, got {role!r}")
    if not isinstance(content, str):
        raise ChatRequestError(f"messages[{index}].content",
                               f"messages[{index}].content must be a string, got {type(content).__name__}")
    return {"role": role, "content": content}


def _eos_ids(language_model: LanguageModel) -> frozenset[int]:
    """The ids that end an answer: the tokenizer's eos and the generation config's."""
    configured = getattr(getattr(language_model.model, "generation_config", None), "eos_token_id", None)
    ids = [configured] if isinstance(configured, int) else list(configured or [])
    if language_model.tokenizer.eos_token_id is not None:
        ids.append(language_model.tokenizer.eos_token_id)
    if not ids:
        raise ValueError(f"language_model ({language_model.name}) names no end-of-sequence token")
    return frozenset(int(i) for i in ids)
