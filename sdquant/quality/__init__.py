"""Quality: metrics and prompt adherence, and the scene models that make them measurable."""
