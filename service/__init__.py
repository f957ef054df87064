"""DAS rollout service: gateway, Ray actors, trainer client and CLI."""
