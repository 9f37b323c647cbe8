"""One-line integrations into the JAX trainers RL users run (each imports its trainer lazily):

    rlk_xla.integrations.tunix.use_rlk()   Tunix's GRPO and PPO learners (docs/integrations.md)
"""
