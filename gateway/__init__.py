"""OpenAI-compatible HTTP gateway in front of the control plane."""
