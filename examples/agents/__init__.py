"""Agent harnesses that train through k3rl's OpenAI-compatible endpoint (`k3rl/Agent-v0`)."""
