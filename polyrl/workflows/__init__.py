"""Multi-agent workflows: several policy calls per episode under named roles, one trajectory per
role with its own reward (advantages are computed per role within each group).

A workflow is an :class:`polyrl.envs.base.EnvBuilder` that overrides ``rollout(ctx)``; it is
configured in ``environments:`` like any environment (``type: solver_judge``). Importing this
package registers every workflow (:mod:`polyrl.envs.registry` does, next to the built-ins); a new
one is a module here, imported below.
"""

from polyrl.workflows import solver_judge  # noqa: F401 - registers solver_judge
