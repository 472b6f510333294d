"""Multi-agent workflows: several policy calls per episode under named roles, one trajectory per
role with its own reward (advantages are computed per role within each group).

A workflow is an :class:`polyrl.envs.base.EnvBuilder` that overrides ``rollout(ctx)``; it is
configured in ``environments:`` like any environment (``type: solver_judge``).
"""
