"""One-line integrations into the trainers RL users run (each imports its trainer lazily):

    torch_bridge.integrations.trl.use_rlk(trainer)   TRL's GRPOTrainer / RLOOTrainer (docs/integrations.md)
"""
