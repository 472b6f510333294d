"""What StableReinforce needs recorded per sampled sequence, and the provenance that names it.

A sampling request made with ``record_stability_info=True`` has each of its sequences recorded
under the sequence's ``sequence_id``: the request's prompt, the sampled tokens and the sampler's
logprobs of them. A training datum then says where each of its tokens came from with provenance
spans (``Datum.with_provenance``: runs of a request's prompt, or of a sequence's sampled tokens);
:meth:`SequenceRecords.resolve` checks the spans against the records (every token must be the one
recorded there) and hands the loss the *recorded* sampler logprobs of the sampled positions, so a
learner can never be fed logprobs the sampler did not produce. A prompt's images take part as the
positions they fill (:func:`input_positions`): a datum's picture matches a recorded one only where it is
the same picture (its bytes and format) at the same positions.

Records belong to the session that sampled them (in ``polyrl serve`` an API key's session; in-process
the ``ServiceClient``), and to nobody else. As Tinker documents, a record can be trained on for one
day after sampling and each training use restarts that day. Memory is bounded per owner: past
``max_tokens`` recorded tokens (prompt and sampled tokens of each sequence), the least recently used
records are evicted first; naming an evicted, expired or unknown sequence is a user error that says so.
"""

from __future__ import annotations

import hashlib
import threading
import time
from collections import OrderedDict
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import numpy as np
from tinker import types

RECORD_TTL_S = 86_400.0  # a day without training use, as Tinker documents
DEFAULT_MAX_RECORDED_TOKENS = 1 << 24  # per owner: ~100 MB of int32 tokens and float32 logprobs
MAX_SEQUENCE_ID_CHARS = 128


def input_positions(model_input: types.ModelInput) -> np.ndarray:
    """``model_input``'s positions as int32 values: a text token's id, and at each position an image fills
    its mark, a negative number drawn from a hash of the image (its bytes and format, or where an asset
    pointer names it), so that two positions compare equal only for the same token or the same picture."""
    parts = []
    for chunk in model_input.chunks:
        if chunk.type == "encoded_text":
            parts.append(np.asarray(chunk.tokens, dtype=np.int32))
            continue
        if isinstance(chunk, types.ImageChunk):
            what = chunk.format.encode() + b"\0" + chunk.data
        else:
            what = repr(chunk.model_dump(exclude={"expected_tokens"})).encode()
        digest = int.from_bytes(hashlib.blake2b(what, digest_size=8).digest(), "little")
        parts.append(np.full(chunk.length, -1 - digest % (2**31 - 1), dtype=np.int32))
    return np.concatenate(parts) if parts else np.zeros(0, dtype=np.int32)


def _shown(value: int) -> str:
    return f"token {value}" if value >= 0 else "an image"


@dataclass
class _Record:
    session: str
    prompt: np.ndarray  # int32, the request's prompt positions (shared by its sequences; input_positions)
    tokens: np.ndarray  # int32, the sampled tokens
    logprobs: np.ndarray  # float32, the sampler's logprob of each sampled token
    last_used: float

    @property
    def size(self) -> int:
        return len(self.prompt) + len(self.tokens)


@dataclass
class SampledInputs:
    """What provenance tells the loss about one datum's target positions."""

    sampled: np.ndarray  # bool [N]: the target is a sampled token
    sampler_logprobs: np.ndarray  # float32 [N]: its recorded sampler logprob (0 elsewhere)


class SequenceRecords:
    """Recorded sequences by owner (LRU order), each tagged with its session. Thread-safe: sampling
    results are recorded from the engine's worker thread, looked up from the server's or the caller's."""

    def __init__(self, max_tokens: int = DEFAULT_MAX_RECORDED_TOKENS, ttl_s: float = RECORD_TTL_S,
                 clock: Callable[[], float] = time.monotonic):
        self.max_tokens = max_tokens
        self.ttl_s = ttl_s
        self._clock = clock
        self._lock = threading.Lock()
        self._by_owner: dict[str, OrderedDict[str, _Record]] = {}
        self._sizes: dict[str, int] = {}

    def add(self, owner: str, session: str, prompt: Sequence[int] | np.ndarray,
            sequences: Sequence[tuple[str, Sequence[int], Sequence[float]]]) -> None:
        """Record a request's sequences: ``(sequence_id, tokens, logprobs)`` each, all from ``prompt`` (its
        token ids, or :func:`input_positions` of a prompt with images)."""
        shared = np.asarray(prompt, dtype=np.int32)
        now = self._clock()
        with self._lock:
            records = self._by_owner.setdefault(owner, OrderedDict())
            for sequence_id, tokens, logprobs in sequences:
                old = records.pop(sequence_id, None)
                if old is not None:
                    self._sizes[owner] -= old.size
                rec = _Record(session, shared, np.asarray(tokens, dtype=np.int32),
                              np.asarray(logprobs, dtype=np.float32), now)
                records[sequence_id] = rec
                self._sizes[owner] = self._sizes.get(owner, 0) + rec.size
            self._prune(owner, now)

    def drop_session(self, session: str) -> None:
        """Forget a finished session's records."""
        with self._lock:
            for owner, records in self._by_owner.items():
                for sid in [s for s, r in records.items() if r.session == session]:
                    self._sizes[owner] -= records.pop(sid).size

    def sweep(self) -> None:
        """Drop the records unused for a day."""
        now = self._clock()
        with self._lock:
            for owner in list(self._by_owner):
                self._prune(owner, now)

    def tokens(self, owner: str) -> int:
        with self._lock:
            return self._sizes.get(owner, 0)

    def _prune(self, owner: str, now: float) -> None:
        """Expired records, then the least recently used while the owner is past ``max_tokens``."""
        records = self._by_owner.get(owner)
        while records:
            sid, rec = next(iter(records.items()))
            if now - rec.last_used <= self.ttl_s and self._sizes[owner] <= self.max_tokens:
                break
            del records[sid]
            self._sizes[owner] -= rec.size

    def _take(self, owner: str, session: str, sequence_id: str, now: float) -> _Record:
        records = self._by_owner.get(owner, OrderedDict())
        rec = records.get(sequence_id)
        if rec is None or rec.session != session:
            shown = sequence_id if len(sequence_id) <= MAX_SEQUENCE_ID_CHARS else sequence_id[:40] + "..."
            raise ValueError(
                f"sequence_id {shown!r} is not recorded for this session: it was not sampled here with "
                f"record_stability_info=True, or went unused for a day ({self.ttl_s:g} s), or was evicted as "
                f"the least recently used when this key's records passed {self.max_tokens} tokens")
        rec.last_used = now
        records.move_to_end(sequence_id)
        return rec

    def resolve(self, owner: str, session: str, data: Sequence[types.Datum]) -> list[SampledInputs]:
        """Check every datum's provenance against the records (a ValueError naming the datum and the
        problem) and return, per datum, which targets were sampled and their recorded logprobs. Each
        record it uses starts its day again."""
        now = self._clock()
        with self._lock:
            self._prune(owner, now)
            out = [self._resolve_datum(i, d, lambda sid: self._take(owner, session, sid, now))
                   for i, d in enumerate(data)]
        return out

    @staticmethod
    def _resolve_datum(i: int, datum: types.Datum, take: Callable[[str], _Record]) -> SampledInputs:
        if datum.model_input_spans is None or datum.loss_fn_input_spans is None:
            raise ValueError(f"data[{i}] has no provenance spans; stable_reinforce needs every datum to name "
                             "the sampled sequences its tokens come from (Datum.with_provenance, with the "
                             "sequence_id of each SampledSequence of a record_stability_info=True sampler)")
        tokens = input_positions(datum.model_input)
        target = datum.loss_fn_inputs["target_tokens"].to_numpy()
        if target.ndim != 1:
            raise ValueError(f"data[{i}]: stable_reinforce takes target_tokens of shape (N,), not "
                             f"{list(target.shape)}")
        _walk(f"data[{i}].model_input_spans", datum.model_input_spans, tokens, take, None)
        sampled = np.zeros(len(target), dtype=bool)
        logprobs = np.zeros(len(target), dtype=np.float32)
        _walk(f"data[{i}].loss_fn_input_spans", datum.loss_fn_input_spans, target, take, (sampled, logprobs))
        return SampledInputs(sampled, logprobs)


def check_tiling(i: int, datum: types.Datum, n_inputs: int, n_targets: int) -> None:
    """Provenance, when a datum has it, must come as a pair of span lists tiling model_input and the
    targets exactly (what ``Datum.with_provenance`` checks on the client)."""
    if datum.model_input_spans is None and datum.loss_fn_input_spans is None:
        return
    for name, spans, n in (("model_input_spans", datum.model_input_spans, n_inputs),
                           ("loss_fn_input_spans", datum.loss_fn_input_spans, n_targets)):
        if spans is None:
            raise ValueError(f"data[{i}] has provenance spans for one field but no {name}: provenance comes "
                             "as a pair")
        covered = sum(s.length for s in spans)
        if covered != n:
            raise ValueError(f"data[{i}].{name} cover {covered} positions but the field has {n}; the runs "
                             "must tile it exactly")


def _walk(where: str, spans: Sequence[types.PromptProvenanceSpan | types.SampledProvenanceSpan],
          values: np.ndarray, take: Callable[[str], _Record],
          sampled_out: tuple[np.ndarray, np.ndarray] | None) -> None:
    """Check that ``spans`` tile ``values`` and that each position holds the recorded token; with
    ``sampled_out`` (the targets), mark the sampled positions and copy their recorded logprobs. Targets
    under a prompt span are not compared: the loss never trains them, and clients fill them with
    placeholders (tinker-cookbook's ``rl_loop`` pads them with token 0)."""
    pos = 0
    for k, span in enumerate(spans):
        rec = take(span.sequence_id)
        is_sampled = isinstance(span, types.SampledProvenanceSpan)
        source = rec.tokens if is_sampled else rec.prompt
        what = "sampled tokens" if is_sampled else "prompt"
        end = span.offset + span.length
        if end > len(source):
            raise ValueError(f"{where}[{k}] names positions [{span.offset}, {end}) of sequence "
                             f"{span.sequence_id!r}'s {what}, which has {len(source)}")
        if pos + span.length > len(values):
            raise ValueError(f"{where} cover more than the field's {len(values)} positions")
        here = values[pos:pos + span.length]
        recorded = source[span.offset:end]
        bad = np.flatnonzero(here != recorded) if is_sampled or sampled_out is None else []
        if len(bad):
            j = int(bad[0])
            held, want = _shown(int(here[j])), _shown(int(recorded[j]))
            if held == want:  # two images
                held, want = "an image", "another image"
            raise ValueError(f"{where}[{k}]: position {pos + j} holds {held}, but sequence "
                             f"{span.sequence_id!r}'s {what} has {want} at {span.offset + j}")
        if sampled_out is not None and is_sampled:
            sampled_out[0][pos:pos + span.length] = True
            sampled_out[1][pos:pos + span.length] = rec.logprobs[span.offset:end]
        pos += span.length
    if pos != len(values):
        raise ValueError(f"{where} cover {pos} positions but the field has {len(values)}; the runs must "
                         "tile it")
