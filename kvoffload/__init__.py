"""kvoffload."""
