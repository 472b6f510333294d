"""Per-key quotas of ``polyrl serve``: what one API key may have in flight at once, so that no key
starves the others.

:class:`Quotas` is part of :class:`~polyrl.serve.server.Server` (a base class of it), kept here so that
each file has one job. It uses the server's ``config`` (the limits), ``usage`` (what each key holds) and
``models`` (data waiting for earlier seq_ids).
"""

from __future__ import annotations

from polyrl.serve.protocol import RequestError
from polyrl.serve.state import ModelRecord


class Quotas:
    def waiting_room(self, rec: ModelRecord, seq_id: int, tokens: int) -> None:
        """A 400 (using up ``seq_id``) when data waiting for earlier seq_ids would pass the key's tokens in
        flight. Not a 429: the SDK sends a call's later chunks first and its first only once all of those
        are accepted, so a chunk turned away for now would leave the call waiting for good."""
        waiting = 0
        for r in self.models.values():
            if r.owner == rec.owner:
                r.waiting_tokens = {s: n for s, n in r.waiting_tokens.items() if s in r.ops.waiting}
                waiting += sum(r.waiting_tokens.values())
        limit = self.config.max_tokens_in_flight
        if waiting and waiting + tokens > limit:
            e = RequestError(400, f"this key's forward_backward data waiting for earlier seq_ids would reach "
                                  f"{waiting + tokens} tokens, past its limit of {limit} "
                                  "(--max-tokens-in-flight); a forward_backward call's chunks wait together "
                                  "for its first: send smaller calls")
            rec.ops.refuse(seq_id, e)
            raise e

    IN_FLIGHT = {"tokens": ("max_tokens_in_flight", "tokens (forward_backward data and sampling prompts)"),
                  "samples": ("max_samples_in_flight", "samples")}

    def in_flight_room(self, owner: str, what: str, amount: int) -> None:
        """A 429 the SDK waits out (Retry-After) when ``amount`` more would pass the key's limit; a key with
        nothing in flight always gets one request in (that request's own size is bounded elsewhere).
        Only for requests nothing waits on (see :meth:`waiting_room`)."""
        name, label = self.IN_FLIGHT[what]
        limit, held = getattr(self.config, name), self.usage.held(owner, what)
        if held and held + amount > limit:
            flag = "--" + name.replace("_", "-")
            raise RequestError(429, f"this key has {held} {label} in flight; {amount} more would pass its "
                                    f"limit of {limit} ({flag}); retry once earlier requests finish",
                               retry_after=1)
