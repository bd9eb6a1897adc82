"""Response-side extraction, as in InferDPT: a local model rewrites the upstream's answer for the user's own prompt.

The upstream answered a perturbed prompt; the local model sees the user's original prompt and that answer,
and writes the answer to the original. It runs on the user's machine, after the release, on the release's
output and the user's own data: post-processing, so it costs no privacy. It is off by default; a small
local model (SmolLM2-135M by default) can lose as much as it recovers, so measure it on your task.
"""

from __future__ import annotations

import json
from collections.abc import AsyncIterator
from typing import Any

from privlm.models.chat import ChatModel
from privlm.validation import check_positive_int

INSTRUCTION = ("You answer the user's question. Another assistant answered a noisy version of the same question; "
               "its draft may help, or may be about the wrong details. Write the answer to the user's question.")


class AnswerExtractor:
    """Rewrites an answer with ``chat_model`` (greedy, at most ``max_tokens`` tokens, or fewer where the request
    asked for fewer: ``limit``)."""

    def __init__(self, chat_model: ChatModel, *, max_tokens: int = 256) -> None:
        self.chat_model = chat_model
        self.max_tokens = check_positive_int("max_tokens", max_tokens)

    def messages(self, prompt: str, answer: str) -> list[dict[str, str]]:
        question = f"Question:\n{prompt}\n\nDraft answer:\n{answer}\n\nAnswer to the question:"
        return [{"role": "system", "content": INSTRUCTION}, {"role": "user", "content": question}]

    def extract(self, prompt: str, answer: str, *, limit: int | None = None) -> str:
        """The local model's answer to ``prompt``, given the upstream's ``answer`` (blocking), in at most
        ``limit`` tokens (the request's own cap) when that is below the extractor's."""
        max_tokens = self.max_tokens if limit is None else min(self.max_tokens, check_positive_int("limit", limit))
        return self.chat_model.generate(self.messages(prompt, answer), max_tokens=max_tokens, temperature=0.0).text

    def rewrite_completion(self, prompt: str, completion: dict[str, Any], *, limit: int | None = None
                           ) -> dict[str, Any]:
        """A chat completion (JSON) with every choice's text content rewritten (in at most ``limit`` tokens, as
        :meth:`extract`); the upstream's kept under ``privlm_upstream_content`` in each choice's message."""
        for choice in completion.get("choices") or []:
            message = choice.get("message") if isinstance(choice, dict) else None
            if isinstance(message, dict) and isinstance(message.get("content"), str):
                message["privlm_upstream_content"] = message["content"]
                message["content"] = self.extract(prompt, message["content"], limit=limit)
        return completion


async def collect_stream(chunks: AsyncIterator[bytes]) -> dict[int, str]:
    """The text of each choice of an OpenAI chat stream (SSE), by choice index, once the stream has ended."""
    texts: dict[int, str] = {}
    buffer = b""
    async for chunk in chunks:
        buffer += chunk
        *events, buffer = buffer.replace(b"\r\n", b"\n").split(b"\n\n")
        for event in events:
            _add_event(texts, event)
    _add_event(texts, buffer)
    return texts


def _add_event(texts: dict[int, str], event: bytes) -> None:
    for line in event.split(b"\n"):
        if not line.startswith(b"data:"):
            continue
        data = line[5:].strip()
        if not data or data == b"[DONE]":
            continue
        try:
            payload = json.loads(data)
        except ValueError:
            continue
        for choice in payload.get("choices") or [] if isinstance(payload, dict) else []:
            delta = choice.get("delta") if isinstance(choice, dict) else None
            if isinstance(delta, dict) and isinstance(delta.get("content"), str):
                index = int(choice.get("index", 0))
                texts[index] = texts.get(index, "") + delta["content"]
