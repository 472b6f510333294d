"""``polyrl serve``: polyrl's local engine behind Tinker's HTTP protocol.

``tinker.ServiceClient(base_url="http://127.0.0.1:8000", api_key="tml-...")`` (and so the
tinker-cookbook, and polyrl's own ``backend: tinker``) then trains and samples on this machine.

Modules: :mod:`~polyrl.serve.app` (the web app: routers wired, auth, errors, read timeouts, background
tasks), :mod:`~polyrl.serve.routes` (the endpoints, in routers), :mod:`~polyrl.serve.server` (the
:class:`Server` that composes the state and its config), :mod:`~polyrl.serve.sessions` (sessions and
training clients, stored), :mod:`~polyrl.serve.training` (training clients' operations),
:mod:`~polyrl.serve.sampling` (sampling sessions and requests), :mod:`~polyrl.serve.lifecycle` (checkpoints
and runs: access, saves, TTLs, publishing, copies, downloads, listings), :mod:`~polyrl.serve.quotas`
(per-key quotas), :mod:`~polyrl.serve.work` (the engine's queue and base models), :mod:`~polyrl.serve.state`
(futures, per-model order, records), :mod:`~polyrl.serve.protocol` (wire formats in),
:mod:`~polyrl.serve.output_wire` and :mod:`~polyrl.serve.sample_wire` (results out), :mod:`~polyrl.serve.runs`
(training runs and checkpoints in the store), :mod:`~polyrl.serve.main` (the command line).
"""

__all__ = ["ServeConfig", "Server"]


def __getattr__(name: str):  # lazy: ``polyrl --help`` should not import torch
    if name in __all__:
        from polyrl.serve import server

        return getattr(server, name)
    raise AttributeError(name)
