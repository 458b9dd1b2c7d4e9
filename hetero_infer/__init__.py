"""Process entry points and small pieces shared by the three planes (no torch here)."""
