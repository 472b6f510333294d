"""The RL training core: ``polyrl train``'s loop (train), the run's resources (run), a step's rollouts
(rollouts, rollout_queue, episode), its scoring and advantages (scoring, advantages), the update (update),
its metrics (step_metrics) and the policy clients (policy)."""
