"""Errors about what the user asked for, as opposed to bugs."""

from __future__ import annotations


class UserInputError(ValueError):
    """What the user asked for cannot be done as given: a missing model directory or checkpoint, a
    malformed path, a bad config value. The message names the problem in one line; the command line
    prints it as ``error: ...`` and exits with code 2, without a traceback."""


class RunStoppedError(RuntimeError):
    """A run cannot go on for a reason found while it ran: a service that stopped answering past its
    retry budget, or too many steps without an update. The message is one line saying why and which
    checkpoint a relaunch resumes from; the command line prints it as ``error: ...`` and exits with
    code 1, without a traceback."""


class NonFiniteUpdateError(ValueError):
    """An optimizer step was refused because the loss or the gradient it would apply is not finite
    (NaN or inf). The weights stay as they were; the message is one line naming the step's problem.
    A ``ValueError``, so ``polyrl serve`` reports it as a problem with the request's data."""


class ServiceLostError(RunStoppedError):
    """A remote training service no longer knows this run's session, model, sampler or pending requests
    (it restarted, or expired them): retrying the request cannot succeed, reopening the run from its last
    checkpoint can. ``polyrl train`` does that a bounded number of times; past it, or elsewhere, the run
    stops like any :class:`RunStoppedError`."""


class CheckpointWriteError(RunStoppedError):
    """A checkpoint could not be written: a full disk, a store that became read-only or went away.
    Nothing of it is left in the store; the message is one line naming the checkpoint and the
    problem (a run that hits it stops, naming the last checkpoint it did save)."""
