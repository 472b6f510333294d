"""Per-key quotas of ``polyrl serve``: what one API key may have in flight at once, and the training
clients' memory it may keep, so that no key starves the others.

:class:`Quotas` holds what each key has in flight (:class:`~polyrl.serve.state.Usage`) and reads the key's
training clients from :class:`~polyrl.serve.sessions.Models` and the loaded models' shapes from the engine.
(A key's live sessions are capped by :class:`~polyrl.serve.sessions.Sessions` itself.)
"""

from __future__ import annotations

from concurrent.futures import Future

from polyrl.local.model import LoraSpec
from polyrl.serve.protocol import RequestError
from polyrl.serve.sessions import Models
from polyrl.serve.state import ModelRecord, Usage


class Quotas:
    def __init__(self, config, models: Models, engine) -> None:
        self._config = config  # read at each call: the limits
        self._models = models
        self._engine = engine
        self._usage = Usage()

    def hold(self, owner: str, until: Future, **amounts: int) -> None:
        """Count ``amounts`` (``tokens``, ``samples``, ``decode``) as ``owner``'s in flight until ``until`` is
        done."""
        self._usage.hold(owner, until, **amounts)

    def waiting_room(self, rec: ModelRecord, seq_id: int, tokens: int) -> None:
        """A 400 (using up ``seq_id``) when data waiting for earlier seq_ids would pass the key's tokens in
        flight. Not a 429: the SDK sends a call's later chunks first and its first only once all of those
        are accepted, so a chunk turned away for now would leave the call waiting for good."""
        waiting = 0
        for r in self._models.of(rec.owner):
            r.waiting_tokens = {s: n for s, n in r.waiting_tokens.items() if s in r.ops.waiting}
            waiting += sum(r.waiting_tokens.values())
        limit = self._config.max_tokens_in_flight
        if waiting and waiting + tokens > limit:
            e = RequestError(400, f"this key's forward_backward data waiting for earlier seq_ids would reach "
                                  f"{waiting + tokens} tokens, past its limit of {limit} "
                                  "(--max-tokens-in-flight); a forward_backward call's chunks wait together "
                                  "for its first: send smaller calls")
            rec.ops.refuse(seq_id, e)
            raise e

    IN_FLIGHT = {"tokens": ("max_tokens_in_flight", "tokens (forward_backward data and sampling prompts)"),
                 "samples": ("max_samples_in_flight", "samples"),
                 "decode": ("max_decode_tokens_in_flight", "tokens to decode (num_samples x max_tokens)")}

    def in_flight_room(self, owner: str, what: str, amount: int) -> None:
        """A 429 the SDK waits out (Retry-After) when ``amount`` more would pass the key's limit; a key with
        nothing in flight always gets one request in (that request's own size is bounded elsewhere).
        Only for requests nothing waits on (see :meth:`waiting_room`)."""
        name, label = self.IN_FLIGHT[what]
        limit, held = getattr(self._config, name), self._usage.held(owner, what)
        if held and held + amount > limit:
            flag = "--" + name.replace("_", "-")
            raise RequestError(429, f"this key has {held} {label} in flight; {amount} more would pass its "
                                    f"limit of {limit} ({flag}); retry once earlier requests finish",
                               retry_after=1)

    # ---- what a key keeps --------------------------------------------------------------------------
    def adapter_room(self, owner: str, base_name: str, lora: LoraSpec) -> int:
        """The bytes a new training client of ``lora`` on ``base_name`` holds (adapter, gradient, optimizer
        moments: ``ADAPTER_BYTES_PER_PARAMETER`` per LoRA parameter; 0 while the base model is not loaded),
        or a 4xx naming the limit it passes: its rank (400), the key's training clients or their memory
        (403)."""
        cfg, rank = self._config, lora.rank
        if rank > cfg.max_lora_rank:
            raise RequestError(400, f"lora rank {rank} is more than this server allows "
                                    f"(--max-lora-rank {cfg.max_lora_rank})")
        # the key's training clients (read from the engine's thread too: the list is taken at once)
        mine = [r for r in self._models.of(owner) if not (r.ready.done() and r.ready.exception() is not None)]
        if len(mine) >= cfg.max_models:
            raise RequestError(403, f"this key has {len(mine)} training clients, the most this server allows "
                                    f"per key (--max-models {cfg.max_models}); close their sessions to make "
                                    "more")
        base = next((m for m in self._engine.loaded_models() if m.name == base_name), None)
        if base is None:
            return 0
        if rank > base.width:
            raise RequestError(400, f"lora rank {rank} is more than model {base_name!r}'s width "
                                    f"({base.width}): a higher rank adds nothing")
        size = ADAPTER_BYTES_PER_PARAMETER * base.lora_parameters(lora)
        held = sum(r.adapter_bytes for r in mine)
        if held + size > cfg.max_adapter_bytes:
            raise RequestError(403, f"a rank-{rank} adapter of {base_name!r} holds {_mb(size)} (weights, "
                                    f"gradient, optimizer state); this key's training clients hold "
                                    f"{_mb(held)} of the {_mb(cfg.max_adapter_bytes)} this server allows per "
                                    "key (--max-adapter-bytes): close sessions, or use a lower rank")
        return size


ADAPTER_BYTES_PER_PARAMETER = 16  # float32 weight, gradient and the optimizer's two moments


def _mb(n: int) -> str:
    return f"{n / 2**20:.1f} MiB"
