"""GRPO through the rollout service with TRL's GRPOTrainer: see README.md here."""
