"""Parameter validation with messages that name the offending parameter."""

from __future__ import annotations

import math
from numbers import Real
from typing import TypeVar

import torch
from pydantic import BaseModel, ValidationError

Choice = TypeVar("Choice", bound=str)
Model = TypeVar("Model", bound=BaseModel)


def check_positive_finite(name: str, value: object) -> float:
    """Return ``value`` as a float, or raise ``ValueError`` if it is not a finite number > 0."""
    if isinstance(value, bool) or not isinstance(value, Real):
        raise ValueError(f"{name} must be a real number, got {type(value).__name__}: {value!r}")
    value = float(value)
    if math.isnan(value) or math.isinf(value):
        raise ValueError(f"{name} must be finite, got {value}")
    if value <= 0:
        raise ValueError(f"{name} must be > 0, got {value}")
    return value


def check_non_negative_finite(name: str, value: object) -> float:
    """Return ``value`` as a float, or raise ``ValueError`` if it is not a finite number >= 0."""
    if isinstance(value, bool) or not isinstance(value, Real):
        raise ValueError(f"{name} must be a real number, got {type(value).__name__}: {value!r}")
    value = float(value)
    if not math.isfinite(value) or value < 0:
        raise ValueError(f"{name} must be finite and >= 0, got {value}")
    return value


def check_in_interval(name: str, value: object, low: float, high: float, *, low_open: bool = False,
                      high_open: bool = False) -> float:
    """Return ``value`` as a float, or raise ``ValueError`` if it is not a finite real number in ``[low, high]``
    (an end excluded when ``low_open``/``high_open``)."""
    interval = f"{'(' if low_open else '['}{low:g}, {high:g}{')' if high_open else ']'}"
    number = float(value) if isinstance(value, Real) and not isinstance(value, bool) else math.nan
    above = low < number if low_open else low <= number
    below = number < high if high_open else number <= high
    if not (math.isfinite(number) and above and below):
        raise ValueError(f"{name} must be a finite number in {interval}, got {value!r}")
    return number


def check_positive_int(name: str, value: object) -> int:
    """Return ``value`` or raise ``ValueError`` if it is not an integer >= 1."""
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"{name} must be an integer >= 1, got {value!r}")
    return value


def check_choice(name: str, value: object, choices: tuple[Choice, ...]) -> Choice:
    """Return ``value`` if it is one of ``choices``, else raise ``ValueError`` naming them."""
    if value not in choices:
        raise ValueError(f"{name} must be one of {choices}, got {value!r}")
    return value  # narrowed to Choice by the membership test


def check_float_tensor(name: str, value: object, *, ndim: int | None = None, min_ndim: int = 1,
                       allow_minus_inf: bool = False) -> torch.Tensor:
    """Check that ``value`` is a non-empty, finite (or -inf, where allowed), floating-point tensor of the expected
    rank."""
    if not isinstance(value, torch.Tensor):
        raise ValueError(f"{name} must be a torch.Tensor, got {type(value).__name__}")
    if not value.is_floating_point():
        raise ValueError(f"{name} must have a floating-point dtype, got {value.dtype}")
    if ndim is not None and value.ndim != ndim:
        raise ValueError(f"{name} must have {ndim} dimensions, got shape {tuple(value.shape)}")
    if value.ndim < min_ndim:
        raise ValueError(f"{name} must have at least {min_ndim} dimension(s), got shape {tuple(value.shape)}")
    if value.numel() == 0:
        raise ValueError(f"{name} must not be empty, got shape {tuple(value.shape)}")
    if not (torch.isfinite(value) | (allow_minus_inf & torch.isneginf(value))).all():
        raise ValueError(f"{name} contains NaN or {'+inf' if allow_minus_inf else 'inf'}")
    return value


def check_level(name: str, value: object) -> float | torch.Tensor:
    """A privacy level: a finite number > 0, or a non-empty floating tensor of them (one per row)."""
    if not isinstance(value, torch.Tensor):
        return check_positive_finite(name, value)
    if not value.is_floating_point() or value.numel() == 0:
        raise ValueError(f"{name} must be a number or a non-empty floating-point tensor, got "
                         f"{value.dtype} of shape {tuple(value.shape)}")
    if not torch.isfinite(value).all() or (value <= 0).any():
        raise ValueError(f"{name} must be finite and > 0 in every row")
    return value


def validated(model: type[Model], data: object, *, refusal: str) -> Model:
    """``data`` as ``model``, or a ``ValueError`` of one line: ``refusal``, then each field and what is wrong."""
    try:
        return model.model_validate(data)
    except ValidationError as error:
        problems = "; ".join(f"{'.'.join(map(str, problem['loc'])) or 'the whole'}: {problem['msg']}"
                             for problem in error.errors(include_url=False))
        raise ValueError(f"{refusal}: {problems}") from None
