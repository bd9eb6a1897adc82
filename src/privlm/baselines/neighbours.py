"""Nearest candidates, and CUSTEXT's output sets built from them and cached on disk.

CUSTEXT (Chen et al., Findings of ACL 2023, arXiv 2022) maps every token to a fixed output set of
K tokens (K = 20). Its Algorithm 1, on the candidate vocabulary C of the device model:

    unassigned <- C (in token id order: a public, fixed order)
    while unassigned is not empty:
        x <- the first unassigned candidate
        S <- the min(K, |unassigned|) unassigned candidates nearest to x (Euclidean on the
             embedding rows; x itself first)
        every member of S gets the output set S; remove S from unassigned

Assigned tokens leave both the inputs and the outputs of later searches (the paper's Algorithm 1
removes each output set from both, "X <- X \\ Y', Y <- Y \\ Y'"; so does the reference code's
"conservative" mapping strategy, which moves assigned rows to 1e9). So the
output sets partition C into groups of K tokens (the last one holds |C| mod K when that is not 0),
every member of a group has the group as its output set, and two tokens either share their output
set or have disjoint ones. CUSTEXT's guarantee holds only within a group; which group a token
belongs to is public and revealed by the output (see :mod:`privlm.baselines.custext`).

Cost. Only the ~|C| / K founders need a search, each over the still unassigned candidates. They
are found in blocks: the distances from the next unassigned candidates (the likely founders) to
every unassigned candidate are one matrix product per block, and each founder's top-K is one
``torch.topk`` over its row, masked by what the block has assigned so far. Rows of candidates that
a founder earlier in the block assigns are computed for nothing; blocks are sized to keep that
waste small. No |C| x |C| matrix is ever held: a block is at most 256 x |C|.

Cache. The groups are data-independent, so they are built once per vocabulary and K and kept in
``cache_dir()/neighbours/<sha256 of the vocabulary fingerprint, K and the format>.safetensors``
(safetensors: tensors and string metadata only, never a pickle), written to a temporary file and
renamed into place. A file that cannot be read, or whose metadata or contents do not match this
vocabulary and K, is rebuilt with a warning. Ties in distance are broken by ``torch.topk`` in
float32: the cached file is the public artefact that fixes them.
"""

from __future__ import annotations

import hashlib
import os
import tempfile
import warnings
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors import SafetensorError, safe_open
from safetensors.torch import save_file

from privlm.mechanisms import nearest_neighbours
from privlm.models.sources import cache_dir
from privlm.models.vocabulary import CandidateVocabulary
from privlm.validation import check_positive_int

CUSTEXT_K = 20
FORMAT = "privlm/custext-output-sets/1"  # part of the cache key: a new construction gets new files
_PAD = -1  # fills the last group's row when |C| is not a multiple of K


def check_token_ids(name: str, token_ids: object, vocabulary: CandidateVocabulary) -> torch.Tensor:
    """An integer tensor of token ids, each a row of ``vocabulary``'s embedding table."""
    if not isinstance(token_ids, torch.Tensor):
        raise ValueError(f"{name} must be a torch.Tensor of token ids, got {type(token_ids).__name__}")
    if token_ids.is_floating_point() or token_ids.is_complex() or token_ids.dtype == torch.bool:
        raise ValueError(f"{name} must hold integer token ids, got dtype {token_ids.dtype}")
    n_ids = vocabulary.embeddings.shape[0]
    if token_ids.numel() and (int(token_ids.min()) < 0 or int(token_ids.max()) >= n_ids):
        raise ValueError(f"{name} must hold token ids in [0, {n_ids}), got values in "
                         f"[{int(token_ids.min())}, {int(token_ids.max())}]")
    return token_ids.long().to(vocabulary.device)


def check_k(k: object, vocabulary: CandidateVocabulary) -> int:
    k = check_positive_int("k", k)
    if k > vocabulary.size:
        raise ValueError(f"k must be at most the number of candidates {vocabulary.size}, got {k}")
    return k


def nearest_candidates(vocabulary: CandidateVocabulary, token_ids: torch.Tensor, k: int, *,
                       chunk_size: int = 1024) -> tuple[torch.Tensor, torch.Tensor]:
    """Candidate indices and distances (each (..., k), nearest first) of the k candidates nearest to each id.

    Any token id may be asked, special or unknown ones included; chunked, so memory is chunk_size x |C|.
    """
    token_ids = check_token_ids("token_ids", token_ids, vocabulary)
    k = check_k(k, vocabulary)
    return nearest_neighbours(vocabulary.rows_of(token_ids), vocabulary.candidate_embeddings, k=k,
                              chunk_size=chunk_size)


@dataclass(frozen=True, eq=False)
class OutputSets:
    """CUSTEXT's partition of the candidates into output sets (groups) of K, by candidate index."""

    members: torch.Tensor  # (G, K) int64: each group in ascending order (its founder first); -1 pads the last
    group_of: torch.Tensor  # (|C|,) int64: the group of every candidate
    k: int
    fingerprint: str  # the vocabulary's fingerprint

    @property
    def n_groups(self) -> int:
        return int(self.members.shape[0])

    @property
    def sizes(self) -> torch.Tensor:
        """(G,) members per group: K, except perhaps the last."""
        return (self.members != _PAD).sum(dim=-1)

    def members_of(self, groups: torch.Tensor) -> torch.Tensor:
        """(..., K) candidate indices of each group, -1 where the last group is short."""
        return self.members[groups]


def _block_rows(n_unassigned: int, k: int) -> int:
    # Founders found ahead of time: a block of about 1 / (4K) of the unassigned candidates, whose founders
    # assign some of the block's later rows (computed for nothing); 64 to 256 rows (at most 256 x |C| floats).
    return max(64, min(256, n_unassigned // (4 * k)))


def build_output_sets(vocabulary: CandidateVocabulary, k: int = CUSTEXT_K) -> OutputSets:
    """CUSTEXT's Algorithm 1 (see the module doc), without the cache."""
    k = check_k(k, vocabulary)
    table = vocabulary.candidate_embeddings
    squared_norms = table.pow(2).sum(-1)
    assigned = torch.zeros(vocabulary.size, dtype=torch.bool, device=table.device)
    group_of = torch.full((vocabulary.size,), _PAD, dtype=torch.long, device=table.device)
    groups: list[torch.Tensor] = []
    while not bool(assigned.all()):
        free = (~assigned).nonzero().squeeze(1)  # ascending: token id order
        founders = free[: _block_rows(free.numel(), k)]
        # ||x - y||^2 up to the per-row constant ||x||^2, which does not change a row's order.
        block = torch.addmm(squared_norms[free], table[founders], table[free].T, alpha=-2.0)
        rows = torch.arange(founders.numel(), device=table.device)
        block[rows, rows] = -torch.inf  # founders are the first columns: each is its own nearest
        taken = torch.zeros(free.numel(), dtype=torch.bool, device=table.device)
        n_taken = 0
        for row in range(founders.numel()):
            if taken[row]:
                continue  # assigned by a founder earlier in this block
            size = min(k, free.numel() - n_taken)
            nearest = torch.topk(block[row], size, largest=False).indices
            block.index_fill_(1, nearest, torch.inf)  # assigned: out of every later search (O(block x K), not O(|C|))
            taken[nearest], n_taken = True, n_taken + size
            group_of[free[nearest]] = len(groups)
            # Ascending: a canonical form (the founder, the group's smallest index, comes first).
            groups.append(torch.nn.functional.pad(free[nearest].sort().values, (0, k - size), value=_PAD))
        assigned[free[taken]] = True
    return OutputSets(members=torch.stack(groups), group_of=group_of, k=k, fingerprint=vocabulary.fingerprint)


# --- the disk cache ------------------------------------------------------------------------------

class StaleCacheError(ValueError):
    """A cache file that does not hold this vocabulary's output sets."""


def output_sets_path(vocabulary: CandidateVocabulary, k: int, *, root: Path | None = None) -> Path:
    """Where the output sets of ``vocabulary`` and ``k`` are cached (``root``: cache_dir()/neighbours)."""
    key = hashlib.sha256(f"{FORMAT}\n{vocabulary.fingerprint}\n{k}".encode()).hexdigest()[:32]
    return (root if root is not None else cache_dir() / "neighbours") / f"{key}.safetensors"


def _metadata(vocabulary: CandidateVocabulary, k: int) -> dict[str, str]:
    return {"privlm_format": FORMAT, "fingerprint": vocabulary.fingerprint, "k": str(k),
            "candidates": str(vocabulary.size)}


def write_output_sets(path: Path, sets: OutputSets, vocabulary: CandidateVocabulary) -> None:
    """Write atomically: to a temporary file in the same folder, then rename over ``path``."""
    path.parent.mkdir(parents=True, exist_ok=True)
    handle, temporary = tempfile.mkstemp(prefix=f".{path.name}.", dir=path.parent)
    os.close(handle)
    try:
        save_file({"members": sets.members.cpu().contiguous(), "group_of": sets.group_of.cpu().contiguous()},
                  temporary, metadata=_metadata(vocabulary, sets.k))
        os.replace(temporary, path)
    except BaseException:
        Path(temporary).unlink(missing_ok=True)
        raise


def read_output_sets(path: Path, vocabulary: CandidateVocabulary, k: int) -> OutputSets:
    """Load and check a cached file; :class:`StaleCacheError` says why it cannot be used."""
    try:
        with safe_open(str(path), framework="pt") as handle:
            metadata = handle.metadata() or {}
            tensors = {name: handle.get_tensor(name) for name in handle.keys()}  # noqa: SIM118 (not a dict)
    except (SafetensorError, OSError, ValueError, RuntimeError) as error:
        raise StaleCacheError(f"not a readable safetensors file ({error})") from error
    expected = _metadata(vocabulary, k)
    if metadata != expected:
        wrong = sorted(key for key in expected.keys() | metadata.keys() if metadata.get(key) != expected.get(key))
        raise StaleCacheError(f"its metadata does not match this vocabulary and k (differs in: {', '.join(wrong)})")
    members, group_of = tensors.get("members"), tensors.get("group_of")
    if members is None or group_of is None or set(tensors) != {"members", "group_of"}:
        raise StaleCacheError(f"it holds tensors {sorted(tensors)}, not members and group_of")
    check_partition(members, group_of, vocabulary.size, k)
    return OutputSets(members=members.to(vocabulary.device), group_of=group_of.to(vocabulary.device), k=k,
                      fingerprint=vocabulary.fingerprint)


def check_partition(members: torch.Tensor, group_of: torch.Tensor, n_candidates: int, k: int) -> None:
    """Groups of K that cover every candidate once (only the last may be short), and agree with group_of."""
    n_groups = -(-n_candidates // k)
    if members.dtype != torch.long or members.shape != (n_groups, k):
        raise StaleCacheError(f"members must be int64 of shape {(n_groups, k)}, got {members.dtype} "
                              f"{tuple(members.shape)}")
    if group_of.dtype != torch.long or group_of.shape != (n_candidates,):
        raise StaleCacheError(f"group_of must be int64 of shape {(n_candidates,)}, got {group_of.dtype} "
                              f"{tuple(group_of.shape)}")
    full, last = members[:-1], members[-1]
    valid = last != _PAD
    short = n_candidates - k * (n_groups - 1)
    if (full == _PAD).any() or not bool(valid[:short].all()) or bool(valid[short:].any()):
        raise StaleCacheError("every group but the last must be full, and the last padded only at its end")
    listed = torch.cat([full.reshape(-1), last[valid]])
    if (listed < 0).any() or (listed >= n_candidates).any() \
            or not bool((torch.bincount(listed, minlength=n_candidates) == 1).all()):
        raise StaleCacheError("the groups must hold every candidate exactly once")
    owners = torch.arange(n_groups).unsqueeze(1).expand(n_groups, k)
    if not torch.equal(group_of[members[members != _PAD]], owners[members != _PAD]):
        raise StaleCacheError("group_of disagrees with members")


def load_output_sets(vocabulary: CandidateVocabulary, k: int = CUSTEXT_K, *, root: Path | None = None,
                     use_cache: bool = True) -> OutputSets:
    """The cached output sets, built (in seconds) and cached when missing or unusable."""
    k = check_k(k, vocabulary)
    if not use_cache:
        return build_output_sets(vocabulary, k)
    path = output_sets_path(vocabulary, k, root=root)
    if path.exists():
        try:
            return read_output_sets(path, vocabulary, k)
        except StaleCacheError as error:
            warnings.warn(f"rebuilding the CUSTEXT output sets cached in {path}: {error}", stacklevel=2)
    sets = build_output_sets(vocabulary, k)
    try:
        write_output_sets(path, sets, vocabulary)
    except OSError as error:  # a read-only or full cache: the sets are still correct, only not kept
        warnings.warn(f"could not cache the CUSTEXT output sets in {path}: {error}", stacklevel=2)
    return sets
