"""``polyrl serve``: polyrl's local engine behind Tinker's HTTP protocol.

``tinker.ServiceClient(base_url="http://127.0.0.1:8000", api_key="tml-...")`` (and so the
tinker-cookbook, and polyrl's own ``backend: tinker``) then trains and samples on this machine.

Modules: :mod:`~polyrl.serve.app` (routes, auth, body limits, read timeouts), :mod:`~polyrl.serve.server`
(operations on the engine: sessions, training clients, futures), :mod:`~polyrl.serve.sampling` (sampling
sessions and requests), :mod:`~polyrl.serve.quotas` (per-key quotas), :mod:`~polyrl.serve.lifecycle`
(checkpoint TTLs, publishing, copies, downloads), :mod:`~polyrl.serve.state` (futures, per-model order,
sessions), :mod:`~polyrl.serve.protocol` (wire formats in), :mod:`~polyrl.serve.output_wire` and
:mod:`~polyrl.serve.sample_wire` (results out), :mod:`~polyrl.serve.runs` (training runs and checkpoints),
:mod:`~polyrl.serve.main` (the command line).
"""

__all__ = ["ServeConfig", "Server"]


def __getattr__(name: str):  # lazy: ``polyrl --help`` should not import torch
    if name in __all__:
        from polyrl.serve import server

        return getattr(server, name)
    raise AttributeError(name)
